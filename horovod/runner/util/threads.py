"""Thread helpers with the names, signatures and behaviour of Horovod's
`horovod.runner.util.threads`.

- `in_thread(target, args=(), name=None, daemon=True, silent=False)` starts `target(*args)` in a
  thread and returns the started thread.
- `on_event(event, func, args=(), stop=None, check_stop_interval_s=1.0, silent=False)` runs
  `func(*args)` in a thread once `event` is set, unless `stop` is set first.
- `execute_function_multithreaded(fn, args_list, block_until_all_done=True,
  max_concurrent_executions=1000)` calls `fn(*args)` for every entry of `args_list` on a pool of
  threads and returns `{index: result}` (or None when not blocking).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Dict, Optional, Sequence

__all__ = ["in_thread", "on_event", "execute_function_multithreaded"]


def _check_args(args: Any) -> None:
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args)}, "
                         "for a single argument use (arg,)")


def in_thread(target: Callable[..., Any], args: tuple = (), name: Optional[str] = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Run `target(*args)` in a new thread and return it (already started).

    With `silent=True` an exception raised by `target` is swallowed instead of being reported by
    the thread's exception hook.
    """
    _check_args(args)
    body = target
    if silent:
        def body(*call_args: Any) -> None:
            try:
                target(*call_args)
            except BaseException:  # silent means silent, as in Horovod
                pass
    thread = threading.Thread(target=body, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(event: threading.Event, func: Callable[..., Any], args: tuple = (),
             stop: Optional[threading.Event] = None, check_stop_interval_s: float = 1.0,
             silent: bool = False) -> threading.Thread:
    """Run `func(*args)` in a background thread as soon as `event` is set.

    When `stop` is given it is checked every `check_stop_interval_s` seconds while waiting; once it
    is set the thread ends without calling `func`. Returns the (daemon) thread.
    """
    if event is None:
        raise ValueError("Event must not be None")
    _check_args(args)
    if stop is not None and not isinstance(stop, threading.Event):
        raise ValueError(f"Stop must be a threading.Event, not {type(stop)}")
    if check_stop_interval_s <= 0:
        raise ValueError(f"Check stop interval must be positive, not {check_stop_interval_s}")

    def wait_then_call() -> None:
        if stop is None:
            event.wait()
        else:
            while not event.wait(check_stop_interval_s):
                if stop.is_set():
                    return
        func(*args)

    return in_thread(wait_then_call, silent=silent)


def execute_function_multithreaded(
        fn: Callable[..., Any], args_list: Sequence[Sequence[Any]],
        block_until_all_done: bool = True,
        max_concurrent_executions: int = 1000) -> Optional[Dict[int, Any]]:
    """Call `fn(*args_list[i])` for every i on at most `max_concurrent_executions` threads.

    Blocking (the default): waits for all calls and returns `{i: result}`; raises RuntimeError
    when some call did not complete (its exception is reported by the thread's exception hook).
    Not blocking: the worker threads are daemons and None is returned at once.
    """
    work: "queue.Queue[tuple[int, Sequence[Any]]]" = queue.Queue()
    for index, call_args in enumerate(args_list):
        work.put((index, call_args))
    results: "queue.Queue[tuple[int, Any]]" = queue.Queue()

    def worker() -> None:
        while True:
            try:
                index, call_args = work.get(block=False)
            except queue.Empty:
                return
            results.put((index, fn(*call_args)))

    threads = [in_thread(worker, daemon=not block_until_all_done)
               for _ in range(min(max_concurrent_executions, len(args_list)))]
    if not block_until_all_done:
        return None
    # Join with a timeout in a loop so that Ctrl-C still reaches the main thread.
    while any(thread.is_alive() for thread in threads):
        for thread in threads:
            thread.join(0.1)
    collected: Dict[int, Any] = {}
    while not results.empty():
        index, value = results.get()
        collected[index] = value
    if len(collected) != len(args_list):
        name = getattr(fn, "__name__", repr(fn))
        raise RuntimeError(f"Some threads for func {name} did not complete successfully.")
    return collected
