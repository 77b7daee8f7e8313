"""Lab 05 (sharded data parallelism: ZeRO-2, ZeRO-3 and FSDP as Megatron-FSDP does them):
its runs and tables (:mod:`.lessons`), its checks and the FSDP-unit exercise
(:mod:`.exercises`, on the playground of :mod:`.fsdp_unit`), Megatron-core's own Megatron-FSDP
on a CPU (:mod:`.megatron_core`), and its picture (:mod:`.viz`)."""
