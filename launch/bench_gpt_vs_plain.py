"""What does the tensor-parallel machinery cost when there is nothing to split?

    python launch/bench_gpt_vs_plain.py                      # CPU: a small shape, fp32
    python launch/bench_gpt_vs_plain.py --preset gpt2-small  # GPU: GPT-2 small in bf16
    torchrun --standalone --nproc-per-node 1 launch/bench_gpt_vs_plain.py   # the same, via torchrun

One process. ``GPTModel`` at TP=1 (column/row-parallel layers, vocab-parallel embedding,
``[s, b, h]`` layout, communication tags) and :class:`mpu_lab.training.plain_gpt.PlainGPT` (``nn.Linear``,
``nn.Embedding``, the same SDPA) of identical shape and identical weights train on the same
batches with AdamW. They are timed in interleaved blocks (A B, B A, A B, ...) so drift of the
machine (other jobs, clocks) hits both; the result is the ratio of median step times
(target <= 1.05).

On a GPU it also prints tokens/s and the model FLOPs utilisation

    MFU = tokens/s x (6 N + 12 L h s) / peak FLOP/s

with ``N`` the parameters doing matrix multiplies (all but the position embedding; the tied
embedding counts once, as the output layer) and ``12 L h s`` the attention scores and
weighted sum (PaLM, appendix B). Peak: dense bf16 of the device (H100/H200 SXM 989 TFLOP/s;
``--peak-tflops`` overrides).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

PRESETS = {
    # name: layers, hidden, heads, seq, micro batch, vocab
    "cpu-small": dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256,
                      micro_batch_size=4, vocab_size=4096),
    "gpt2-small": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024,
                       micro_batch_size=16, vocab_size=50304),   # 50257 padded to 128
}
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4),
                    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0)]


def parse(argv):
    p = argparse.ArgumentParser(description="GPTModel (TP=1) vs a plain PyTorch GPT: step time")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="default: gpt2-small on a GPU, cpu-small otherwise")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "vocab_size"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--precision", choices=["fp32", "bf16-autocast", "bf16"], default=None,
                   help="default: bf16 (parameters and activations) on a GPU, fp32 on the CPU")
    p.add_argument("--rounds", type=int, default=16, help="interleaved blocks per model")
    p.add_argument("--steps", type=int, default=None, help="steps per block (default 2 CPU, 10 GPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p.parse_args(argv)


def peak_tflops(device) -> float:
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS:
        if key in name:
            return value
    return float("nan")


def flops_per_token(model, num_layers, hidden, seq) -> float:
    n = sum(p.numel() for name, p in model.named_parameters() if "position_embeddings" not in name)
    return 6.0 * n + 12.0 * num_layers * hidden * seq


def main(argv=None):
    a = parse(argv)
    from mpu_lab.training import initialize
    from mpu_lab import launcher, training
    from mpu_lab.core import parallel_state
    from mpu_lab.training.checkpointing import gather_model_state_dict
    from mpu_lab.core.models.gpt import GPTModel
    from mpu_lab.training.plain_gpt import PlainGPT
    from mpu_lab.core.transformer import TransformerConfig
    from mpu_lab.core.tensor_parallel import model_parallel_manual_seed

    use_cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        os.environ.setdefault("MPU_LAB_DEVICE", "cpu")
    initialize.init_single_process()
    if parallel_state.get_tensor_model_parallel_world_size() != 1:
        raise SystemExit("run this benchmark with one process (TP=1)")
    device = initialize.get_device()
    shape = dict(PRESETS[a.preset or ("gpt2-small" if device.type == "cuda" else "cpu-small")])
    for k in shape:
        if getattr(a, k) is not None:
            shape[k] = getattr(a, k)
    precision = a.precision or ("bf16" if device.type == "cuda" else "fp32")
    steps = a.steps or (10 if device.type == "cuda" else 2)

    model_parallel_manual_seed(1234)
    config = TransformerConfig(num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
                               num_attention_heads=shape["num_attention_heads"])
    gpt = GPTModel(config, shape["vocab_size"], shape["seq_length"])
    plain = PlainGPT.from_config(config, shape["vocab_size"], shape["seq_length"]).to(device)
    plain.load_state_dict(gather_model_state_dict(gpt))
    if precision == "bf16":
        gpt, plain = gpt.to(torch.bfloat16), plain.to(torch.bfloat16)
    models = {"GPTModel(TP=1)": gpt, "PlainGPT": plain}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device.type == "cuda")
                  for k, m in models.items()}
    forwards = {k: (torch.compile(m) if a.compile else m) for k, m in models.items()}

    g = torch.Generator().manual_seed(0)
    B, S, V = shape["micro_batch_size"], shape["seq_length"], shape["vocab_size"]
    # Drawn from a seeded CPU generator (the same tokens on any device), then moved.
    batches = [torch.randint(0, V, (B, S + 1), generator=g).to(device)  # cpu: seeded, moved
               for _ in range(4)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-autocast" \
        else None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(name, i):
        batch = batches[i % len(batches)]
        optimizers[name].zero_grad(set_to_none=True)
        if autocast is not None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = forwards[name](batch[:, :-1], labels=batch[:, 1:]).mean()
        else:
            loss = forwards[name](batch[:, :-1], labels=batch[:, 1:]).mean()
        loss.backward()
        optimizers[name].step()
        return loss

    # Same weights, same batch: the first losses agree (fp32: to rounding).
    first = {k: float(step(k, 0).detach()) for k in models}
    for k in models:
        for i in range(a.warmup):
            step(k, i + 1)
    times = {k: [] for k in models}
    names = list(models)
    for r in range(a.rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            sync()
            t0 = time.perf_counter()
            for i in range(steps):
                step(k, i)
            sync()
            times[k].append((time.perf_counter() - t0) / steps)

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med[names[0]] / med[names[1]]
    # Each block's time next to the other model's neighbouring block: robust to slow drift.
    paired = statistics.median(x / y for x, y in zip(times[names[0]], times[names[1]]))
    tokens = B * S
    result = dict(device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                  torch=torch.__version__, precision=precision, shape=shape, steps_per_block=steps,
                  rounds=a.rounds, first_loss=first,
                  median_step_s=med, step_time_ratio=ratio, paired_block_ratio=paired,
                  tokens_per_s={k: tokens / v for k, v in med.items()})
    print(f"device: {result['device']}  torch {torch.__version__}  precision: {precision}  "
          f"threads: {torch.get_num_threads()}")
    print("shape: " + ", ".join(f"{k}={v}" for k, v in shape.items()))
    print("first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()))
    for k in names:
        print(f"{k:<16} median step {med[k] * 1e3:9.2f} ms   {tokens / med[k]:12,.0f} tokens/s   "
              f"(blocks: {', '.join(f'{t * 1e3:.1f}' for t in times[k])} ms)")
    print(f"step-time ratio GPTModel / PlainGPT: {ratio:.3f} (medians), {paired:.3f} (median of "
          f"neighbouring-block ratios)  (target <= 1.05)")
    if device.type == "cuda":
        peak = a.peak_tflops or peak_tflops(device)
        fpt = flops_per_token(gpt, shape["num_layers"], shape["hidden_size"], S)
        result["flops_per_token"] = fpt
        result["peak_tflops"] = peak
        result["mfu"] = {k: tokens / v * fpt / (peak * 1e12) for k, v in med.items()}
        for k in names:
            print(f"{k:<16} MFU {100 * result['mfu'][k]:5.1f} %  "
                  f"({fpt / 1e6:.0f} MFLOP/token, peak {peak:.0f} TFLOP/s bf16)")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    launcher.report(result)
    initialize.shutdown()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
