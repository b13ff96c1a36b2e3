"""Where a run ran: device, library versions and the git commit, recorded in every table's metadata."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
MEMINFO = Path("/proc/meminfo")
CPUINFO = Path("/proc/cpuinfo")


def git_commit() -> str | None:
    """HEAD of the checkout rlsweep was imported from, with a '+dirty' mark; None outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=PACKAGE_ROOT, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=PACKAGE_ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo and its architecture, e.g. 'AMD EPYC (x86_64)'; else the architecture."""
    try:
        for line in CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return f"{value.strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: str) -> dict[str, Any]:
    """The device a run computed on: the GPU's name, capability and count, or the CPU's name, ATen's CPU capability
    and torch's threads."""
    if device == "cuda" and torch.cuda.is_available():
        try:
            return {
                "name": torch.cuda.get_device_name(0),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
                "count": torch.cuda.device_count(),
                "cuda": torch.version.cuda,
            }
        except (RuntimeError, AssertionError) as err:  # CUDA cannot be queried: the run's own CUDA checks report it
            return {"name": f"none: CUDA cannot be queried ({' '.join(str(err).split())})", "capability": None}
    if device == "cuda":  # the run stopped on provenance: say so rather than name the CPU as its device
        return {"name": f"none: torch.cuda.is_available() is False on {cpu_name()}", "capability": None}
    # ATen's CPU kernels are chosen by capability (AVX2, AVX512; ATEN_CPU_CAPABILITY sets it), and give other bits.
    capability = torch.backends.cpu.get_cpu_capability()
    return {"name": cpu_name(), "capability": capability, "threads": torch.get_num_threads()}


def available_memory(device: str) -> tuple[int, str] | None:
    """Bytes a run can still allocate on ``device`` and where that figure comes from; None if it cannot be known.

    cuda: the free bytes of the current GPU (torch.cuda.mem_get_info); None without CUDA or when it cannot be
    queried (the run stops before any tensor is made). cpu: MemAvailable of /proc/meminfo, else the available
    physical pages (os.sysconf).
    """
    if device == "cuda":
        if not torch.cuda.is_available():
            return None
        try:
            free, _total = torch.cuda.mem_get_info()
            return free, f"free memory of cuda:{torch.cuda.current_device()} (torch.cuda.mem_get_info)"
        except (RuntimeError, AssertionError):  # CUDA cannot be queried: the run's own CUDA checks report it
            return None
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, f"MemAvailable in {MEMINFO}"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available physical pages (os.sysconf)"
    except (OSError, ValueError, AttributeError):
        return None


def computing_environment(device: str) -> dict[str, Any]:
    """What besides the config, its input files and the code can change a run's numbers: the device (GPU name,
    capability and CUDA version, or the CPU, ATen's CPU capability and torch's thread count) and the versions of
    torch, triton and Python.
    A run's resume hash covers it (``rlsweep.manifest.identify``)."""
    try:  # the installed version, without importing triton (importing it fixes its interpreter mode)
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - triton is a dependency
        triton_version = None
    return {
        "device": device_info(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
    }


def environment(device: str) -> dict[str, Any]:
    """Where a run computed: device, library versions, platform, git commit (the report's Environment section)."""
    return {**computing_environment(device), "platform": platform.platform(), "git_commit": git_commit()}
