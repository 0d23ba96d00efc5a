"""Memory-aware admission control: who runs, who waits, who is refused, decided before a stream starts."""

from .cli import AdmissionSettings, add_arguments, check_budget_after_load, validate
from .controller import AdmissionController, Ticket, guard_stream
from .device_memory import default_headroom_bytes, device_memory_bytes
from .memory_model import MemoryModel, Projection
from .metrics import register_metrics
from .policies import POLICIES

__all__ = [
    "POLICIES",
    "AdmissionController",
    "AdmissionSettings",
    "MemoryModel",
    "Projection",
    "Ticket",
    "add_arguments",
    "check_budget_after_load",
    "default_headroom_bytes",
    "device_memory_bytes",
    "guard_stream",
    "register_metrics",
    "validate",
]
