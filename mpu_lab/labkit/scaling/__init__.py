"""Lab 16, scaling: the back-of-envelope checks (``exercises``) and the roofline of one GPU's links
(``viz``); the explorer's pictures are lab 15's (:mod:`mpu_lab.labkit.performance.viz`).
"""
