"""Whether calls flow: readiness that a dependency's own health cannot show.

After a full disk the broker, router and agents each say they are up again seconds before a
call is answered (JetStream comes back disabled or without leaders, kept replies are lost), so
`/readyz` said 200 while calls hung into their 504. This records the last call that got no
answer (the bus refused it, or nothing replied by its deadline) and keeps readiness red until
a call is answered again. Pure: the clock is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CallFlow:
    stalled_at: float | None = None  # when the last unanswered call gave up; None: flowing
    reason: str = ""

    def stalled(self, reason: str, now: float) -> None:
        """A call got no answer: the bus refused it, or its deadline passed with no reply."""
        self.stalled_at, self.reason = now, reason

    def answered(self, now: float) -> None:
        """A reply came from the router or an agent (an error reply too: the path works)."""
        if self.stalled_at is not None and now >= self.stalled_at:
            self.stalled_at, self.reason = None, ""

    def problem(self) -> str | None:
        """Why calls are not flowing; None while they are."""
        if self.stalled_at is None:
            return None
        return f"calls are not answered ({self.reason}); ready again once one is"
