"""The per-GPU memory ledger `omnistage serve` checks before it starts anything."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.common.memory.units import fmt_bytes


class LedgerError(RuntimeError):
    """The budgets do not fit the devices; the message is the table of every refused device."""

    def __init__(self, message: str, report: LedgerReport | None = None) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class LedgerEntry:
    """One rank of one service on a device."""

    service: str
    rank: int
    budget: int  # bytes; 0 when the service has no budget (then it is not summed)
    how: str  # "40.00 GiB" or "0.50 x 80.00 GiB"


@dataclass(frozen=True)
class DeviceLedger:
    device: str
    total: int
    reserve: int
    entries: tuple[LedgerEntry, ...]

    @property
    def used(self) -> int:
        return self.reserve + sum(e.budget for e in self.entries)

    @property
    def overshoot(self) -> int:
        return self.used - self.total

    @property
    def fits(self) -> bool:
        return self.overshoot <= 0

    def rows(self) -> list[tuple[str, str, str]]:
        out = [
            (self.device, f"{e.service} (rank {e.rank})", e.how if e.budget else "no budget")
            for e in self.entries
        ]
        out.append((self.device, "reserve", fmt_bytes(self.reserve)))
        out.append((self.device, "total", fmt_bytes(self.total)))
        label = "overshoot" if not self.fits else "headroom"
        out.append((self.device, label, fmt_bytes(abs(self.overshoot))))
        return out


@dataclass(frozen=True)
class LedgerReport:
    devices: tuple[DeviceLedger, ...]

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    def table(self, only_refused: bool = False) -> str:
        rows = [("device", "service", "budget")]
        for d in self.devices:
            if not (only_refused and d.fits):
                rows += d.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)

    def summary(self) -> str:
        """One line per device for the start-up log."""
        return "\n".join(
            f"memory ledger: {d.device}: {fmt_bytes(d.used)} of {fmt_bytes(d.total)} budgeted "
            f"({len([e for e in d.entries if e.budget])} ranks, reserve {fmt_bytes(d.reserve)})"
            for d in self.devices
        )


def ledger_device(svc: ServiceConfig, rank: int) -> str | None:
    """The ledger device of a rank: `cuda:N`, `sim:N`, or None for a CPU service without simulation."""
    index = svc.gpu_of(rank)
    if svc.device == "cuda":
        return f"cuda:{index}"
    if svc.memory.simulated_capacity_bytes:
        return f"sim:{index}"
    return None


def placements(cfg: DeployConfig) -> dict[str, list[tuple[ServiceConfig, int]]]:
    """Device → (service, rank) of every rank that lives on it, in deploy-file order."""
    out: dict[str, list[tuple[ServiceConfig, int]]] = {}
    for svc in cfg.services.values():
        for rank in range(svc.tp_size):
            dev = ledger_device(svc, rank)
            if dev is not None:
                out.setdefault(dev, []).append((svc, rank))
    return out


def budgeted_devices(cfg: DeployConfig) -> list[str]:
    """Devices where at least one rank has a budget (the only ones the ledger checks)."""
    return [dev for dev, ranks in placements(cfg).items() if any(s.memory.has_budget for s, _ in ranks)]


def _entry(svc: ServiceConfig, rank: int, total: int) -> LedgerEntry:
    m = svc.memory
    budget = m.budget_of(total)
    how = (
        fmt_bytes(budget)
        if m.budget_bytes
        else f"{fmt_bytes(budget)} ({m.budget_fraction:g} x {fmt_bytes(total)})"
    )
    return LedgerEntry(svc.name, rank, budget, how)


def check_ledger(cfg: DeployConfig, device_totals: Mapping[str, int]) -> LedgerReport:
    """Check every budgeted device; raise LedgerError with the table of those that do not fit.

    `device_totals` maps device names (`cuda:0`, `sim:1`) to total bytes; a budgeted device
    missing from it is an error (the ledger never guesses a size).
    """
    ledgers = []
    place = placements(cfg)
    for dev in budgeted_devices(cfg):
        if dev not in device_totals:
            raise LedgerError(
                f"memory ledger: no total size known for device {dev} (have: {', '.join(device_totals)})"
            )
        total = int(device_totals[dev])
        entries = tuple(_entry(svc, rank, total) for svc, rank in place[dev])
        ledgers.append(DeviceLedger(dev, total, cfg.devices.reserve_bytes, entries))
    report = LedgerReport(tuple(ledgers))
    if not report.fits:
        refused = ", ".join(d.device for d in report.devices if not d.fits)
        raise LedgerError(
            f"memory ledger: budgets exceed device memory on {refused}\n{report.table(only_refused=True)}",
            report,
        )
    return report


def simulated_totals(cfg: DeployConfig) -> dict[str, int]:
    """`sim:N` → capacity; services sharing a simulated GPU must agree on its capacity."""
    totals: dict[str, tuple[int, str]] = {}
    for dev, ranks in placements(cfg).items():
        for svc, _ in ranks:
            cap = svc.memory.simulated_capacity_bytes
            if not dev.startswith("sim:"):
                continue
            if dev in totals and totals[dev][0] != cap:
                have, who = totals[dev]
                raise LedgerError(
                    f"memory ledger: simulated GPU {dev} has capacity {have} in services.{who} but {cap} in "
                    f"services.{svc.name} (memory.simulated_capacity_bytes must agree)"
                )
            totals.setdefault(dev, (cap, svc.name))
    return {dev: cap for dev, (cap, _) in totals.items()}


def cuda_totals(devices: list[str], override: int = 0) -> dict[str, int]:
    """Total bytes of each `cuda:N` (the override when set, else the driver's number)."""
    if override:
        return dict.fromkeys(devices, override)
    if not devices:
        return {}
    import torch  # only when a CUDA service has a budget

    if not torch.cuda.is_available():
        raise LedgerError(
            f"memory ledger: budgets are set on {', '.join(devices)} but CUDA is not available "
            "(set devices.total_bytes_override to check the ledger without GPUs)"
        )
    count = torch.cuda.device_count()
    out = {}
    for dev in devices:
        index = int(dev.split(":")[1])
        if index >= count:
            raise LedgerError(
                f"memory ledger: {dev} is used by the deploy file but this host has {count} GPUs"
            )
        out[dev] = int(torch.cuda.mem_get_info(index)[1])
    return out


def check_deploy_memory(cfg: DeployConfig) -> LedgerReport:
    """What `omnistage serve` runs first: read the device totals the budgets need and check the ledger."""
    needed = budgeted_devices(cfg)
    totals = simulated_totals(cfg)
    totals.update(cuda_totals([d for d in needed if d.startswith("cuda:")], cfg.devices.total_bytes_override))
    return check_ledger(cfg, totals)
