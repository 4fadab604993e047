"""The GPU paths, checked in one command on a machine with one CUDA GPU (under 10 minutes on an H200).

    python benchmarks/device_check.py                 # on the GPU machine
    python benchmarks/device_check.py --smoke         # the same steps on this CPU at toy widths (code path only)

1. The CUDA train path on the tiny MoE (profiles/tiny-moe-cpu.yaml on one GPU: INT4 experts
   dequantized on the device, LoRA, DeepSpeed, the per-phase memory meter): steps, seconds per step,
   held-out accuracy before and after, and each phase's measured peak against the plan; then the same policy streams
   its rows through continuous batching (eager, on the device) against fixed batches: tokens/s, forwards and the kept
   log-probs' difference.
2. A real-width slice: a dense layer and MoE layer(s) at Kimi-K2 width (hidden 7168, routed experts
   of width 2048, INT4 group 32, random weights written by orbitctl.model.synthetic), trained for two
   steps on a long micro-batch; each phase's measured peak (torch.cuda.max_memory_allocated, and the
   device's used memory from NVML) against what `orbitctl plan` predicts for the same profile.
3. Where vLLM is installed: vLLM serves the tiny MoE's INT4 base (as `orbitctl quantize` wrote it,
   compressed-tensors pack-quantized) with the adapter step 1 trained, loaded unmerged at run time
   (POST /v1/load_lora_adapter); its sampled completions with log-probs go through
   `orbitctl verify-alignment --rollouts` against the trainer's path. Skipped, and said so, without
   vLLM; with --smoke the same step runs against `orbitctl serve` (which speaks vLLM's API).
5. Decode at Kimi-K2 width (the slice of step 2, one GPU): the routed INT4 experts as the grouped Triton kernel
   (quant.kernel: fused) against the same experts dequantized one by one, greedy decode tokens/s of each, the grouped
   kernel's largest difference from the dequantizing path on one layer, and the tokens/s the time model predicts for
   the same decode (`orbitctl plan`'s rollout decode of a profile of the slice), and CUDA's tinygemm on a random
   INT4 weight of the slice's width (row independence, difference from the dequantized product), and a fused INT4
   layer's own forward at a decode step's 32 rows and at an update's 4,096 (which kernel the layer runs, its GFLOP/s
   against the bf16 GEMM on the dense weight: tinygemm's rate where the update runs it). The grouped decode runs
   twice: eager, and on the static step replayed from a CUDA graph (rollout.decode_graphs, what train's rollout runs on
   a GPU), each against the plan's prediction for it (decode_graphs false and auto), with the graphed greedy tokens
   against the eager ones.
4. The chunked loss at Kimi-K2's output width (vocabulary 163,840, hidden 7168, 4096 tokens) and
   the activation offload (8 layers, hidden 4096): the peak's fall and the bytes sent to host
   against the plan's logits and boundary terms (benchmarks/memory_mechanics.py).

Prints one table at the end; never part of the test suite or CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from continuous_batching import device_rows as stream_rows
from memory_mechanics import chunked_loss_rows, offload_rows
from phase_memory import memory_rows, print_rows, profile_file, slice_sets, train, write_slice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="run every step on the CPU at toy widths")
    parser.add_argument("--gpu", default="h200", help="the profile's hardware.gpu for this machine (catalog name)")
    parser.add_argument("--steps", type=int, default=20, help="tiny-MoE train steps")
    parser.add_argument("--experts", type=int, default=384, help="routed experts per MoE layer of the slice")
    parser.add_argument("--moe-layers", type=int, default=1, help="MoE layers of the slice (plus one dense layer)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence of the slice's micro-batch")
    parser.add_argument("--work", default="/tmp/orbitctl-device-check", help="scratch directory")
    args = parser.parse_args()

    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run with --smoke to check the code path on the CPU")
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    gpu = "cpu" if args.smoke else args.gpu
    rows: list[tuple[str, str, str]] = []
    if not args.smoke:
        props = torch.cuda.get_device_properties(0)
        rows.append(("device", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, torch {torch.__version__}", ""))

    # 1. the CUDA train path on the tiny MoE
    path = profile_file(work, {"name": "device-tiny-moe", "hardware.gpu": gpu, "hardware.gpus_per_node": 1,
                               "memory.expert_parallel": 1, "run.dir": str(work / "tiny-moe"),
                               "run.eval_every": max(1, args.steps), "run.save_every": 10**6})
    result, seconds = train(path, 3 if args.smoke else args.steps)
    rows.append(("tiny MoE train", f"{result['steps']} steps in {seconds:.0f} s; held-out {result['eval_before']} -> "
                                   f"{result['eval_after']}", "ok" if result["steps"] else "FAIL"))
    rows += memory_rows("tiny MoE", result["last_metrics"])
    rows += stream_rows(path, args.smoke)  # continuous batching: the eager stream on the device against fixed batches
    rows += engine_rows(work, Path(result["run_dir"]), Path(result["adapter_dir"]), args.smoke)

    # 2. the real-width slice
    width = dict(hidden=256, expert_width=128, experts=8, top_k=2) if args.smoke else \
        dict(hidden=7168, expert_width=2048, experts=args.experts, top_k=8)
    import time

    start = time.perf_counter()
    slice_dir, total, routed = write_slice(work / "slice", moe_layers=args.moe_layers, **width)
    rows.append(("slice written", f"{total / 1e9:.2f} GB ({routed / total:.0%} routed experts) in "
                                  f"{time.perf_counter() - start:.0f} s", ""))
    seq = 64 if args.smoke else args.seq_len
    path = profile_file(work, slice_sets(slice_dir, work / "slice-run", gpu, 1, seq, 16 if args.smoke else 64))
    result, seconds = train(path, 2)
    rows.append(("slice train", f"{result['steps']} steps in {seconds:.0f} s", "ok" if result["steps"] else "FAIL"))
    rows += memory_rows("slice", result["last_metrics"])

    # 5. decode at Kimi-K2 width: grouped INT4 experts, measured against the time model
    device = "cpu" if args.smoke else "cuda"
    from moe_decode import decode_rows

    decode_sets = slice_sets(slice_dir, work / "slice-decode", gpu, 1, seq, 8 if args.smoke else 64)
    rows += decode_rows(slice_dir, profile_file(work, {**decode_sets, "name": "decode-slice"}), device,
                        batch=4 if args.smoke else 32, new=8 if args.smoke else 64)

    # 4. the chunked loss and the activation offload against the plan
    rows += chunked_loss_rows(device, args.smoke) + offload_rows(device, args.smoke)
    print_rows(rows)


ORBITCTL = [sys.executable, "-c", "import sys; from orbitctl.cli.app import main; sys.exit(main())"]


def engine_rows(work: Path, run_dir: Path, adapter_dir: Path, smoke: bool) -> list[tuple[str, str, str]]:
    """Step 3: an engine serves the run's base and adapter; verify-alignment --rollouts judges its samples."""
    import importlib.util

    from orbitctl.builder import prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.profile import load_profile
    from orbitctl.rl.engine import free_port

    profile_path = run_dir / "profile.yaml"
    profile = load_profile(str(profile_path))
    if not smoke and importlib.util.find_spec("vllm") is None:
        return [("vLLM step", "skipped: vllm is not installed here (pip install vllm)", "")]
    split = load_prompts(profile.data, profile.run.seed)
    base = prepare_frozen_base(profile, split.warm_task).quantized_dir  # cached by step 1
    port = free_port()
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if smoke:
        command = [*ORBITCTL, "serve", str(profile_path), "--port", str(port), "--allow-adapter-loading",
                   "--adapter-root", str(work.resolve())]  # the fence lets the trained adapter under work/ load
        label = "orbitctl serve (smoke)"
    else:
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(base), "--port",
                   str(port), "--enable-lora", "--max-lora-rank", str(profile.adapter.rank), "--max-model-len", "512",
                   "--return-tokens-as-token-ids", "--logprobs-mode", "processed_logprobs",
                   "--gpu-memory-utilization", "0.5", "--enforce-eager"]
        label = "vLLM"
    log = work / "engine.log"
    started = time.perf_counter()
    with open(log, "wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        if not _wait_health(url, server, 900):
            return [(f"{label} step", f"the engine did not start; see {log}", "FAIL")]
        up = time.perf_counter() - started
        _post(url + "/v1/load_lora_adapter", {"lora_name": "trained", "lora_path": str(adapter_dir.resolve())})
        rollouts = work / "engine_rollouts.jsonl"
        with open(rollouts, "w") as out:
            for item in split.eval[:16]:
                ids = [int(t) for t in _tokenizer(base)(item.prompt)["input_ids"]]
                answer = _post(url + "/v1/completions", {
                    "model": "trained", "prompt": ids, "n": 2, "max_tokens": profile.rollout.max_new_tokens,
                    "temperature": 1.0, "seed": 0, "logprobs": 5, "return_tokens_as_token_ids": True})
                out.write(json.dumps({"prompt_token_ids": ids, "response": answer}) + "\n")
        # the run's own profile: verify-alignment recomputes the tokens with that run's trained adapter
        done = subprocess.run([*ORBITCTL, "verify-alignment", str(profile_path), "--rollouts", str(rollouts),
                               "--json"], capture_output=True, text=True)
        verdict = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
        figures = {"verdict": verdict.get("verdict"), "tokens": verdict.get("tokens"),
                   **{g["name"]: g.get("value") for g in verdict.get("gates", []) if isinstance(g, dict) and "name" in g}}
        return [(f"{label} step", f"engine up in {up:.0f} s; 16 prompts x 2 completions; verify-alignment --rollouts "
                                  f"exit {done.returncode} {json.dumps(figures)}"
                                  + ("" if done.returncode == 0 else f" {done.stderr.strip()[-300:]}"),
                 "ok" if done.returncode == 0 else "FAIL")]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def _tokenizer(base: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(base))


def _wait_health(url: str, server: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return True
        except OSError:
            time.sleep(0.5)
    return False


def _post(url: str, body: dict):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        text = answer.read().decode()
    try:
        return json.loads(text)
    except ValueError:
        return text


if __name__ == "__main__":
    main()
