"""Lab 02, collectives: what collectives cost: the ring all-reduce's bytes and the alpha-beta model
fitted to this machine (``lessons``), and an all-reduce built from point-to-point messages
(``exercises``). Its bandwidth picture is lab 15's (:mod:`mpu_lab.labkit.performance.viz`).
"""
