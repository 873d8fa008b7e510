"""Which device a process computes on, given the GPU addresses Spark assigned to its task: one
rule for training ranks and scoring workers.

Spark addresses are the discovery script's physical ids. Where CUDA_VISIBLE_DEVICES is set (YARN,
Kubernetes, TorchDistributor), CUDA renumbers the visible devices from 0, so an address is looked
up in that list (the wrong-GPU-index bug of horovod PR #3737).

Pure: imports neither torch nor Spark; callers pass what they know.
"""

from __future__ import annotations


def resolve_device(gpu_addresses: list[str], cuda_available: bool, visible_devices: str | None) -> tuple[str, str]:
    """(torch device name, why) for a process given the GPU addresses Spark assigned to its task."""
    if not gpu_addresses:
        return "cpu", "no GPU assigned to this task by Spark"
    address = str(gpu_addresses[0])
    if not cuda_available:
        return "cpu", f"Spark assigned GPU address {address}, but CUDA is not available in this process; using CPU"
    if visible_devices:
        visible = [v.strip() for v in visible_devices.split(",") if v.strip()]
        if address in visible:
            return f"cuda:{visible.index(address)}", f"Spark GPU address {address} (CUDA_VISIBLE_DEVICES={visible_devices})"
        if len(visible) == 1:
            return "cuda:0", f"Spark GPU address {address}; the only visible device"
    return f"cuda:{int(address)}", f"Spark GPU address {address}"


__all__ = ["resolve_device"]
