"""Forward kinematics of a 6-DOF revolute robot arm (PUMA 560) as a Denavit-Hartenberg chain.

Source: the standard Denavit-Hartenberg convention (J. Denavit & R. S. Hartenberg, J. Appl.
Mech. 22 (1955) 215-221), link transform A_i = Rz(theta_i) Tz(d_i) Tx(a_i) Rx(alpha_i) as in
M. W. Spong, S. Hutchinson & M. Vidyasagar, "Robot Modeling and Control" (2006), eq. 3.10;
the PUMA 560 parameters are the standard-DH ones in P. Corke, "Robotics, Vision and
Control" (2011). Roll-pitch-yaw extraction follows J. J. Craig, "Introduction to Robotics",
3rd ed. (2005), eq. 2.66. Benchmark task "RobotArm_6DOF" of Lohoff & Neftci (AlphaGrad),
arXiv:2406.05027.
"""

import jax.numpy as jnp

# PUMA 560, standard DH: (d_i [m], a_i [m], cos(alpha_i), sin(alpha_i)); alpha is one of
# 0 or +-pi/2, stored as exact cosines and sines so no rounding error enters the chain.
DH_PARAMS = (
    (0.0, 0.0, 0.0, 1.0),          # alpha_1 = +pi/2
    (0.0, 0.4318, 1.0, 0.0),       # alpha_2 = 0
    (0.15005, 0.0203, 0.0, -1.0),  # alpha_3 = -pi/2
    (0.4318, 0.0, 0.0, 1.0),       # alpha_4 = +pi/2
    (0.0, 0.0, 0.0, -1.0),         # alpha_5 = -pi/2
    (0.0, 0.0, 1.0, 0.0),          # alpha_6 = 0
)


def _is(x, c):
    """True if ``x`` is the Python constant ``c`` (not a traced value)."""
    return isinstance(x, float) and x == c


def _mul(x, y):
    """x * y, folding exact Python constants 0 and +-1 so they never reach the jaxpr."""
    if _is(x, 0.0) or _is(y, 0.0):
        return 0.0
    if _is(x, 1.0):
        return y
    if _is(y, 1.0):
        return x
    if _is(x, -1.0):
        return -y
    if _is(y, -1.0):
        return -x
    return x * y


def _sum(*terms):
    """The sum of ``terms``, dropping exact Python zeros."""
    terms = [t for t in terms if not _is(t, 0.0)]
    if not terms:
        return 0.0
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def _dh_step(rot, pos, theta, d, a, ca, sa):
    """Compose the pose (rot, pos) with one DH link transform; rot is a 3x3 tuple of rows."""
    ct, st = jnp.cos(theta), jnp.sin(theta)
    link_rot = ((ct, _mul(-1.0, _mul(st, ca)), _mul(st, sa)),
                (st, _mul(ct, ca), _mul(-1.0, _mul(ct, sa))),
                (0.0, sa, ca))
    link_pos = (_mul(a, ct), _mul(a, st), d)
    new_rot = tuple(tuple(_sum(*(_mul(rot[i][k], link_rot[k][j]) for k in range(3))) for j in range(3))
                    for i in range(3))
    new_pos = tuple(_sum(pos[i], *(_mul(rot[i][k], link_pos[k]) for k in range(3))) for i in range(3))
    return new_rot, new_pos


def robot_arm_6dof(q1: "f32[]", q2: "f32[]", q3: "f32[]", q4: "f32[]", q5: "f32[]", q6: "f32[]"):
    """End-effector pose of a PUMA 560 for joint angles q1..q6 (6 scalars, radians).

    Returns a tuple of 6 scalars: the position x, y, z [m] of the tool frame in the
    base frame and its orientation as roll, pitch, yaw [rad] (Craig's X-Y-Z fixed
    angles: R = Rz(yaw) Ry(pitch) Rx(roll)).

    Source: DH forward kinematics (Spong et al. 2006, eq. 3.10) with the PUMA 560
    parameters of Corke 2011; AlphaGrad task RobotArm_6DOF (arXiv:2406.05027).
    """
    rot = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
    pos = (0.0, 0.0, 0.0)
    for theta, (d, a, ca, sa) in zip((q1, q2, q3, q4, q5, q6), DH_PARAMS):
        rot, pos = _dh_step(rot, pos, theta, d, a, ca, sa)
    (r11, _, _), (r21, _, _), (r31, r32, r33) = rot
    yaw = jnp.arctan2(r21, r11)
    pitch = jnp.arctan2(-r31, jnp.sqrt(r11 * r11 + r21 * r21))
    roll = jnp.arctan2(r32, r33)
    x, y, z = pos
    return x, y, z, roll, pitch, yaw


def robot_arm_6dof_example_args():
    """A generic, non-singular configuration (no joint at 0 or +-pi/2)."""
    return tuple(jnp.float32(q) for q in (0.3, -0.6, 0.4, 0.8, -0.5, 0.7))
