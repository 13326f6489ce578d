"""What each precision delivers on this machine: a short matrix-product benchmark per dtype.

Machines of one kind differ. On a CPU with avx512_bf16 or AMX, bf16 matrix
products run about twice as fast as fp32; on an AVX2-only CPU torch emulates
them, and one 512x512 bf16 product ran 68x slower than fp32 (0.9 against 61
GFLOP/s), which made a bf16 training run 20x slower. A catalog cannot know
which CPU a laptop or a cloud VM has, so detect_hardware measures, at the
thread count one training rank will get, and the planner chooses from the
numbers (`planning.precision`). GPUs are measured too, next to the catalog's
peak, so a throttled or misidentified card shows.

The same holds for attention: on the 2-core EPYC with avx512_bf16, torch's
fused `scaled_dot_product_attention` ran a bf16 forward and backward 4.4x slower
than the plain product-softmax-product that transformers calls "eager" (fp32:
0.84x), so bf16 training was slower than fp32 although its products were three
times faster. On a CPU both kernels are timed too (`attention_ms`), and the
planner picks the faster (`planning.attention`).

The measurement takes one to three seconds: each dtype is timed in rounds,
interleaved with the others so that a burst of load from another process
hits all of them alike, and the best round counts.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from stagetrain.hardware.report import ATTENTION_SHAPE, HardwareReport, SpeedReport

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_SIZE = 512
GPU_SIZE = 8192
ROUNDS = 3
ROUND_SECONDS = 0.05
# Instruction-set extensions that decide how fast 16-bit matrix products run on a CPU.
CPU_FLAGS = (
    "avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16",
    "asimd", "sve", "bf16", "fphp",
)  # fmt: skip


def _seconds_per_call(call: Callable[[], object], seconds: float, cuda: bool = False) -> float:
    """Seconds per `call()`, repeating for at least `seconds` (and at least once)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    count, start = 0, time.perf_counter()
    while True:
        call()
        count += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / count


def matmul_gflops(
    device: str, threads: int | None, *, size: int, rounds: int = ROUNDS
) -> dict[str, float]:
    """GFLOP/s of square `size` matrix products per dtype on `device`, best of `rounds`."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        pairs = {}
        for name, dtype in DTYPES.items():
            a = torch.randn(size, size, device=device).to(dtype)
            b = torch.randn(size, size, device=device).to(dtype)
            _seconds_per_call(partial(torch.matmul, a, b), 0.0, a.is_cuda)  # warm-up
            pairs[name] = (a, b)
        best = dict.fromkeys(DTYPES, float("inf"))
        for _ in range(rounds):
            for name, (a, b) in pairs.items():
                seconds = _seconds_per_call(partial(torch.matmul, a, b), ROUND_SECONDS, a.is_cuda)
                best[name] = min(best[name], seconds)
    finally:
        torch.set_num_threads(previous)
    return {name: round(2 * size**3 / s / 1e9, 2) for name, s in best.items()}


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """transformers' eager attention: scaled scores, a causal mask, an fp32 softmax, values."""
    n = q.shape[-2]
    mask = torch.full((n, n), float("-inf"), dtype=q.dtype).triu(1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    return torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype) @ v


def _forward_backward(kernel: Callable[..., torch.Tensor], qkv: tuple[torch.Tensor, ...]) -> None:
    kernel(*qkv).sum().backward()


def attention_ms(threads: int, *, rounds: int = ROUNDS) -> dict[str, dict[str, float]]:
    """Milliseconds of one causal attention forward and backward at ATTENTION_SHAPE, per
    training dtype and kernel ("sdpa": torch's fused one, "eager"), best of `rounds`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    kernels = {"sdpa": _sdpa, "eager": _eager}
    try:
        out: dict[str, dict[str, float]] = {}
        for name in ("fp32", "bf16"):
            qkv = tuple(
                torch.randn(ATTENTION_SHAPE, dtype=DTYPES[name], requires_grad=True)
                for _ in range(3)
            )
            for kernel in kernels.values():
                _seconds_per_call(partial(_forward_backward, kernel, qkv), 0.0)  # warm-up
            best = dict.fromkeys(kernels, float("inf"))
            for _ in range(rounds):
                for key, kernel in kernels.items():
                    seconds = _seconds_per_call(
                        partial(_forward_backward, kernel, qkv), ROUND_SECONDS
                    )
                    best[key] = min(best[key], seconds)
            out[name] = {key: round(s * 1e3, 3) for key, s in best.items()}
    finally:
        torch.set_num_threads(previous)
    return out


def cpu_flags(proc_root: Path = Path("/proc")) -> list[str]:
    """The matrix-relevant instruction-set flags /proc/cpuinfo lists (x86 `flags`, Arm `Features`)."""
    info = proc_root / "cpuinfo"
    if not info.exists():
        return []
    found = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", info.read_text(), re.MULTILINE)
    present = set(found.group(1).split()) if found else set()
    return [flag for flag in CPU_FLAGS if flag in present]


def measure(hardware: HardwareReport) -> SpeedReport:
    """The `speed` entry of hardware.json for the devices `hardware` (detect's result) describes.

    CPU ranks are measured at their share of the cores, the thread count the
    launcher gives each rank; a GPU on its first visible device.
    """
    began = time.perf_counter()
    if hardware["gpu"] is not None:
        if not torch.cuda.is_available():
            return {"device": "cuda", "gflops": None, "reason": "torch sees no CUDA device"}
        entry: SpeedReport = {"device": "cuda", "threads": None, "size": GPU_SIZE,
                              "gflops": matmul_gflops("cuda", None, size=GPU_SIZE)}  # fmt: skip
    else:
        cores, ranks = hardware["cpu"]["cores"], hardware["cpu_ranks"]
        assert cores is not None and ranks is not None, "measured only on detected CPUs"
        threads = max(1, cores // ranks)
        entry = {
            "device": "cpu", "threads": threads, "size": CPU_SIZE,
            "gflops": matmul_gflops("cpu", threads, size=CPU_SIZE),
            "attention_ms": attention_ms(threads),
            "capability": torch.backends.cpu.get_cpu_capability(), "flags": cpu_flags(),
        }  # fmt: skip
    entry["seconds"] = round(time.perf_counter() - began, 2)
    return entry
