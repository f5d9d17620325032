"""The watermark state machine with hysteresis, on the memory fraction of `nodes.memory`. Pure."""

from __future__ import annotations

from admission.nodes.state import Status
from admission.policy import Watermarks

OPEN, HOLD, DRAIN, DOWN, MAINTENANCE = (
    Status.OPEN,
    Status.HOLD,
    Status.DRAIN,
    Status.DOWN,
    Status.MAINTENANCE,
)
STATES = tuple(Status)


def next_state(current: Status, fraction: float, wm: Watermarks) -> Status:
    """Watermark transition with hysteresis (health and maintenance are decided elsewhere).

    open → hold at ≥ hold, → drain at ≥ drain; hold → drain at ≥ drain. Leaving needs the
    fraction to fall a band below the threshold (band = hold − reopen): drain → hold below
    drain − band, hold → open below reopen; so a node hovering at a threshold does not flap.
    """
    band = wm.hold - wm.reopen
    if fraction >= wm.drain:
        return DRAIN
    if current == DRAIN and fraction >= wm.drain - band:
        return DRAIN
    if current in (HOLD, DRAIN):
        return OPEN if fraction < wm.reopen else HOLD
    if fraction >= wm.hold:
        return HOLD
    return OPEN
