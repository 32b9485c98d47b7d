"""A command run in a pseudo-terminal, as a user's terminal runs it: the terminal is its
controlling terminal (Ctrl-C typed into it is SIGINT to its foreground process group), and
stdin, stdout and stderr are all the terminal."""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import termios
import threading
import time
from pathlib import Path


class Terminal:
    def __init__(self, argv: list[str], cwd: Path, rows: int = 0, columns: int = 0) -> None:
        """rows = columns = 0: the size `script -qec CMD /dev/null` reports under a pipe."""
        self._master, slave = os.openpty()
        resize(slave, rows, columns)

        def controlling_terminal() -> None:  # in the child: a session whose terminal is ours
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            preexec_fn=controlling_terminal,
            close_fds=True,
        )
        os.close(slave)
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._master, 4096)
            except OSError:  # EIO: every process holding the terminal has exited
                return
            if not data:
                return
            self._chunks.append(data)

    @property
    def output(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def resize(self, rows: int, columns: int) -> None:
        """As a terminal window resized: the kernel sends SIGWINCH to the foreground group."""
        resize(self._master, rows, columns)

    def type_ctrl_c(self) -> None:
        os.write(self._master, b"\x03")  # the terminal sends SIGINT to the foreground group

    def wait_for(self, text: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.proc.poll() is None, f"ended before {text!r}:\n{self.output}"
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.output}"
            time.sleep(0.05)

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        os.close(self._master)
        return code, self.output


def resize(fd: int, rows: int, columns: int) -> None:
    """Set the size of the pseudo-terminal behind `fd` (either end)."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))


def screen_lines(output: str) -> list[str]:
    """What each terminal line ends up showing: the text after its last carriage return,
    without "erase line" sequences."""
    return [
        line.rstrip("\r").split("\r")[-1].replace(ERASE_LINE, "") for line in output.split("\n")
    ]


ERASE_LINE = "\x1b[K"
