"""A page in real headless Chromium, driven as a person drives it: clicks on what is drawn.

Chromium's DevTools protocol over `--remote-debugging-pipe` (JSON messages ended by a NUL byte
on the child's file descriptors 3 and 4), so neither a websocket client nor a port is needed.
The Snakemake report is a React app with no address per view: what a result shows exists in
the page only after the clicks that lead to it, which `--dump-dom` cannot make.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "chromium"
"""Debian's name for it (a wrapper script; its "[: unexpected operator" line on stderr is harmless)."""


def chromium_or_skip() -> str:
    """The Chromium binary; where there is none the test is skipped and says why (a cluster
    node has no browser; CI has one)."""
    found = shutil.which(CHROMIUM)
    if found is None:
        pytest.skip(f"no {CHROMIUM} on PATH: the report is not opened in a browser here")
    return found


class Page:
    """One tab of a headless Chromium that this object started, over its DevTools pipe."""

    def __init__(self, proc: subprocess.Popen[bytes], commands: int, events: int) -> None:
        self._proc, self._commands, self._events = proc, commands, events
        self._buffer = b""
        self._id = 0
        self._session: str | None = None
        self.events: list[dict[str, Any]] = []
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.send("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.send("Page.enable")
        self.send("Runtime.enable")

    def _message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium sent nothing in time")
            chunk = os.read(self._events, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium closed its pipe (exit {self._proc.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, timeout: float = 30, **params: Any) -> dict[str, Any]:
        """The result of one protocol command, in the attached tab once there is one; the
        events that arrive meanwhile are kept in `events`."""
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if self._session is not None:
            message["sessionId"] = self._session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._message(deadline)
            if reply.get("id") != self._id:
                self.events.append(reply)
            elif "error" in reply:
                raise RuntimeError(f"{method}: {reply['error']}")
            else:
                return reply["result"]

    def evaluate(self, expression: str, context: int | None = None) -> Any:
        """A JavaScript expression's value in the page (or in an execution context of one of
        its frames), thrown errors raised here."""
        params: dict[str, Any] = {"expression": expression, "returnByValue": True}
        if context is not None:
            params["contextId"] = context
        reply = self.send("Runtime.evaluate", **params)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(
        self, expression: str, what: str, timeout: float = 20, context: int | None = None
    ) -> Any:
        """The expression's first truthy value, polled while the page renders; `what` names
        what it waits for, in the error when it never comes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression, context)
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"not in the page after {timeout:.0f} s: {what}")

    def open(self, url: str) -> None:
        """Navigates the tab and waits for the load event."""
        self.send("Page.navigate", url=url)
        deadline = time.monotonic() + 30
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self._message(deadline))

    def click(self, element: str, what: str, timeout: float = 20) -> None:
        """A left click with the mouse at the middle of the element that the JavaScript
        expression `element` finds, once the page draws it: it must be on screen and on top
        there (not hidden, not covered), as for a person."""
        find = f"""(() => {{
            const el = {element};
            if (!el) return null;
            el.scrollIntoView({{block: "center"}});
            const r = el.getBoundingClientRect();
            const x = r.left + r.width / 2, y = r.top + r.height / 2;
            return r.width > 0 && el.contains(document.elementFromPoint(x, y)) ? [x, y] : null;
        }})()"""
        x, y = self.wait_for(find, f"{what}, drawn where a click reaches it", timeout)
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def click_text(self, selector: str, text: str) -> None:
        """A click on the element matching `selector` whose text is `text` (a link by its label)."""
        self.click(
            f"[...document.querySelectorAll({json.dumps(selector)})]"
            f".find(el => el.textContent.trim() === {json.dumps(text)})",
            f"{selector} {text!r}",
        )

    def frame_context(self, url_part: str, timeout: float = 20) -> int:
        """An execution context in the child frame whose address holds `url_part`, once one
        has loaded (an isolated world: the frame's own scripts are not disturbed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tree = self.send("Page.getFrameTree")["frameTree"]
            for child in tree.get("childFrames", []):
                if url_part in child["frame"]["url"]:
                    world = self.send("Page.createIsolatedWorld", frameId=child["frame"]["id"])
                    return world["executionContextId"]
            time.sleep(0.05)
        raise TimeoutError(f"no frame at an address with {url_part} in the page")


def _high(fd: int) -> int:
    """A copy of `fd` numbered 10 or more, so that moving it to 3 or 4 in the child cannot
    overwrite the other end."""
    copy = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return copy


@contextlib.contextmanager
def headless_page(width: int = 1400, height: int = 900) -> Iterator[Page]:
    """A tab of a fresh headless Chromium (its own temporary profile), closed afterwards."""
    binary = chromium_or_skip()
    to_child_r, to_child_w = (_high(fd) for fd in os.pipe())
    from_child_r, from_child_w = (_high(fd) for fd in os.pipe())
    with (
        tempfile.TemporaryDirectory(prefix="chromium-") as profile,
        open(Path(profile) / "stderr", "w+b") as log,
    ):
        # A container has no user namespaces for the sandbox, and no GPU.
        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
        args += [f"--user-data-dir={profile}/profile", f"--window-size={width},{height}"]
        # The pipe's ends become the child's descriptors 3 and 4, where Chromium looks for them.
        move = f'exec 3<&{to_child_r} 4>&{from_child_w}; exec "$@"'
        proc = subprocess.Popen(
            ["bash", "-c", move, "bash", *args, "--remote-debugging-pipe"],
            pass_fds=(to_child_r, from_child_w),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        try:
            yield Page(proc, to_child_w, from_child_r)
        except RuntimeError as err:
            log.seek(0)
            raise RuntimeError(
                f"{err}\nChromium's stderr: {log.read()[-2000:].decode(errors='replace')}"
            ) from err
        finally:
            with contextlib.suppress(OSError):
                os.write(to_child_w, b'{"id":0,"method":"Browser.close"}\0')
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            os.close(to_child_w)
            os.close(from_child_r)


# The rows of the first table in a frame, cell by cell as drawn, once its body has height.
SHOWN_ROWS = """(() => {
    const table = document.querySelector("table");
    if (!table || table.getBoundingClientRect().height === 0) return null;
    return [...table.rows].map(tr => [...tr.cells].map(td => td.innerText));
})()"""
# The content pane's frame of the result named FILENAME, drawn large enough to read.
FRAME_SHOWN = """(() => {
    const r = document.querySelector('iframe[src*="filename=FILENAME;"]')?.getBoundingClientRect();
    return r !== undefined && r.width > 300 && r.height > 300;
})()"""


def shown_report_tables(
    report: Path, category: str, results: dict[str, str]
) -> dict[str, list[list[str]]]:
    """What a person reading `report` (a Snakemake report) sees of each HTML result
    `results[subcategory]` of `category`: its table's rows, after the clicks that show it
    (the category in the menu, the subcategory, the result's eye button; then the category's
    breadcrumb for the next). Snakemake draws an HTML result in a frame of the content pane."""
    shown = {}
    with headless_page() as page:
        page.open(report.resolve().as_uri())
        for n, (subcategory, path) in enumerate(results.items()):
            # First from the menu (nav ul), then back through the breadcrumbs (nav ol).
            page.click_text("nav ol a" if n else "nav ul a", category)
            page.click_text("nav ul a", subcategory)
            page.click(
                '[...document.querySelectorAll("nav tbody tr")]'
                f".find(tr => tr.cells[0].textContent === {json.dumps(path)})"
                '?.querySelector("[role=group] a")',
                f"the eye button of {path}",
            )
            name = Path(path).name
            page.wait_for(FRAME_SHOWN.replace("FILENAME", name), f"{name} in the content pane")
            frame = page.frame_context(f"filename={name};")
            shown[path] = page.wait_for(SHOWN_ROWS, f"a table in {name}", context=frame)
    return shown
