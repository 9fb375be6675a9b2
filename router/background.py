"""A daemon thread running an object's `_run` until it is stopped: the shared index's publishers and
its follower each keep one."""

from __future__ import annotations

import threading


class BackgroundLoop:
    """`_run` (the subclass's) on a daemon thread, which returns once `_stop` is set."""

    def _init_loop(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _stop_loop(self, *wake: threading.Event, timeout: float = 5.0) -> None:
        """Set `_stop` (and `wake`, events the thread may be waiting on), then wait up to timeout for
        the thread; one never started is not waited for."""
        self._stop.set()
        for event in wake:
            event.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
