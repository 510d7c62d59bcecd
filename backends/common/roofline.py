"""Per-march roofline parameters for ``perf_model``'s *estimated* layer times (data, with sources).

A layer's estimated time is ``max(weighted MACs / peak MAC rate, DRAM bytes / bandwidth)``:
the classic roofline bound, at the vendor's peak rates. It is an estimate for comparing
layers and models, not a prediction of measured latency: real BPU utilisation is below
peak, on-chip buffers save DRAM traffic between layers, and fixed per-layer overheads are
ignored. Every number below says where it comes from and what was assumed; replace one
with a measured figure by registering a new :class:`Roofline`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ROOFLINES", "Roofline", "estimate_cpu_seconds", "estimate_seconds", "get_roofline", "register_roofline"]


@dataclass(frozen=True)
class Roofline:
    """Peak rates of one march's BPU and its board memory.

    ``peak_int8_macs_per_s``: int8 x int8 multiply-accumulates per second (TOPS / 2, one MAC
    being two operations). ``dram_bytes_per_s``: theoretical DRAM bandwidth.
    ``int16_mac_cost``: int8-MAC slots one MAC with an int16 operand takes.
    ``sources``: where each number comes from, printed with every estimate.

    The program's CPU float part (``float_fn`` steps, layout on float values) runs on the board's
    application CPU, not the BPU: ``cpu_device`` names it, ``cpu_float_ops_per_s`` is the float32
    operation rate of the one core the float part runs on, and ``cpu_sources`` say where it comes from.
    The CPU shares the board's DRAM (``dram_bytes_per_s``).
    """

    march: str
    device: str
    peak_int8_macs_per_s: float
    dram_bytes_per_s: float
    int16_mac_cost: float
    sources: tuple[str, ...]
    cpu_device: str
    cpu_float_ops_per_s: float
    cpu_sources: tuple[str, ...]

    def describe(self) -> str:
        return (
            f"{self.march} ({self.device}): peak {self.peak_int8_macs_per_s / 1e12:g} T int8 MAC/s, "
            f"DRAM {self.dram_bytes_per_s / 1e9:g} GB/s; CPU part on {self.cpu_device}: "
            f"{self.cpu_float_ops_per_s / 1e9:g} G float op/s"
        )


_INT16_NOTE = (
    "int16 MAC = 4 int8 MAC slots: assumption (a 16x16-bit product built from four 8x8-bit partial "
    "products); the vendor states no int16 rate"
)

ROOFLINES: dict[str, Roofline] = {
    "bernoulli2": Roofline(
        march="bernoulli2",
        device="RDK X3 (Sunrise X3, dual-core Bernoulli 2.0 BPU)",
        peak_int8_macs_per_s=2.5e12,
        dram_bytes_per_s=10.7e9,
        int16_mac_cost=4.0,
        sources=(
            "5 TOPS: the vendor's rating of the X3 BPU (also quoted as 'a 5TOPS BPU' in OpenCV Zoo's benchmark "
            "hardware list for the Sunrise X3); counted as 2.5e12 MAC/s",
            "10.7 GB/s: assumption - a 32-bit LPDDR4 bus at 2666 MT/s (32 / 8 * 2.666e9), the theoretical peak; "
            "not a measured or vendor-stated bandwidth",
            _INT16_NOTE,
        ),
        cpu_device="one Cortex-A53 core at 1.2 GHz",
        cpu_float_ops_per_s=4.8e9,
        cpu_sources=(
            "CPU: the Sunrise X3's application cores are Cortex-A53 (vendor's X3 overview); 1.2 GHz is an "
            "assumption (boards clock them between 1.2 and 1.5 GHz)",
            "4.8 G float op/s: assumption - one core (the float part is one thread of the deployed program) "
            "issuing one 2-lane float32 NEON FMA a cycle (A53's 64-bit NEON datapath): 4 ops x 1.2e9",
        ),
    ),
    "bayes": Roofline(
        march="bayes",
        device="RDK Ultra (Journey 5 class, dual-core Bayes BPU)",
        peak_int8_macs_per_s=48e12,
        dram_bytes_per_s=25.6e9,
        int16_mac_cost=4.0,
        sources=(
            "96 TOPS: the RDK Ultra board's marketed rating, unverified (the figure with a checked source is the "
            "Journey 5 chip's 128 TOPS, in the vendor's J5 OpenExplorer overview); counted as 48e12 MAC/s",
            "25.6 GB/s: assumption - a 64-bit LPDDR4 bus at 3200 MT/s (64 / 8 * 3.2e9), the theoretical peak; "
            "not a measured or vendor-stated bandwidth",
            _INT16_NOTE,
        ),
        cpu_device="one Cortex-A55 core at 1.5 GHz",
        cpu_float_ops_per_s=12e9,
        cpu_sources=(
            "CPU: the Journey 5's application cores are Cortex-A55 (vendor's J5 overview); 1.5 GHz is an assumption",
            "12 G float op/s: assumption - one core (the float part is one thread of the deployed program) "
            "issuing one 4-lane float32 NEON FMA a cycle: 8 ops x 1.5e9",
        ),
    ),
}


def register_roofline(r: Roofline) -> None:
    """Use ``r`` for its march from now on (e.g. with measured numbers)."""
    ROOFLINES[r.march] = r


def get_roofline(march: str) -> Roofline:
    try:
        return ROOFLINES[march]
    except KeyError:
        raise ValueError(
            f"no roofline parameters for march {march!r} (known: {', '.join(sorted(ROOFLINES))}); "
            "add them with backends.common.roofline.register_roofline"
        ) from None


def _roof(t_compute: float, t_memory: float) -> tuple[float, str]:
    if t_compute == 0.0 and t_memory == 0.0:
        return 0.0, "-"
    return (t_compute, "compute") if t_compute >= t_memory else (t_memory, "memory")


def estimate_seconds(r: Roofline, weighted_macs: float, dram_bytes: float) -> tuple[float, str]:
    """``(seconds, bound)``: the roofline time and whether ``compute`` or ``memory`` bounds it."""
    return _roof(weighted_macs / r.peak_int8_macs_per_s, dram_bytes / r.dram_bytes_per_s)


def estimate_cpu_seconds(r: Roofline, float_ops: float, dram_bytes: float) -> tuple[float, str]:
    """``(seconds, bound)`` of a CPU float step: ``max(float ops / CPU rate, bytes / DRAM bandwidth)``."""
    return _roof(float_ops / r.cpu_float_ops_per_s, dram_bytes / r.dram_bytes_per_s)
