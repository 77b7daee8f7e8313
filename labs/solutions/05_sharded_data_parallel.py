# Lab 05: answers to the write-the-code exercise. Load them on purpose, in a new cell:
#     %load solutions/05_sharded_data_parallel.py
# run that cell, then grade them:
#     grader.grade((solution_fully_shard, solution_sharded_step), exercises.FSDP_UNIT, world)
# They run on the ranks, where torch, dist and comm exist.


def solution_fully_shard(unit):
    def unshard():                                 # all-gather the shards: the whole unit
        unit.install(comm.all_gather(unit.shard, unit.group))

    def reshard():                                 # free the whole parameters
        for p in unit.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def pre_forward(module, args):
        unshard()

    def post_forward(module, args, output):
        reshard()
        if output.requires_grad:                   # its gradient arrives just before backward
            output.register_hook(lambda grad: unshard())

    ready = []

    def grad_ready(param):
        ready.append(param)
        if len(ready) == len(unit.params):         # the unit's backward is done
            ready.clear()
            unit.shard_grad += comm.reduce_scatter(unit.flat_grads(), unit.group) / unit.d
            reshard()

    unit.module.register_forward_pre_hook(pre_forward)
    unit.module.register_forward_hook(post_forward)
    for p in unit.params:
        p.register_post_accumulate_grad_hook(grad_ready)


def solution_sharded_step(unit, lr):
    with torch.no_grad():
        unit.shard -= lr * unit.shard_grad         # each rank updates its own 1/d only
