"""Megatron's tensor-parallel unit tests, by name, with the layout each one runs on.

The one copy of the layouts: ``launch/collectives.py`` runs each test on these sizes, and
lab 08's pictures (:func:`mpu_lab.labkit.tp_mappings.viz.collective_views`) and checks
(:func:`mpu_lab.labkit.tp_mappings.exercises.check_megatron_expectations`) rebuild what each rank should
hold from them. Standard library only, so a torchrun worker imports it for nothing.
"""

# name: (tensor-parallel size, pipeline-parallel size) on 8 ranks, as in Megatron's tests.
COLLECTIVE_LAYOUTS = {"broadcast": (2, 4), "copy": (4, 2), "reduce": (4, 2), "scatter": (4, 2),
                      "gather": (4, 2), "gather_split": (2, 4), "sequence": (4, 2)}
