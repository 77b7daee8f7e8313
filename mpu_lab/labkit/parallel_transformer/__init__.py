"""Lab 09, a parallel transformer layer: the shape table, a layer's collectives and the
vocabulary-parallel cross entropy to write (``exercises``), the layer, its activation memory and
its backward on a timeline (``viz``), and the overlap verdict computed from the step times it
prints (``lessons``).
"""
