"""An sshd on every host (`pdserve testbed up --no-ray`, then `ray up cluster/testbed.yaml` over ssh):
root with the testbed's key, each session with the testbed's HOME (its `session` ForceCommand)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.testbed.plan import SSHD, TestbedError
from cluster.testbed.processes import _run

if TYPE_CHECKING:
    from cluster.testbed.control import Testbed


def _start_sshd(tb: Testbed, say) -> None:
    if not tb.ssh_key.exists():
        _run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"pdserve-testbed-{tb.prefix}", "-f", str(tb.ssh_key)]
        )
    host_key = tb.ssh_dir / "host_ed25519"
    if not host_key.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)])
    (tb.ssh_dir / "authorized_keys").write_text(tb.ssh_key.with_suffix(".pub").read_text())
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    for host in tb.hosts:
        d = tb.host_dir(host)
        config = d / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress {host.ip}",
                    "Port 22",
                    f"HostKey {host_key}",
                    f"PidFile {d / 'sshd.pid'}",
                    f"AuthorizedKeysFile {tb.ssh_dir / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PrintMotd no",
                    "AcceptEnv none",
                    f"ForceCommand {tb.bin_dir / 'session'}",
                    "MaxStartups 64:30:128",
                    "MaxSessions 64",
                    "LogLevel ERROR",
                    "",
                ]
            )
        )
        _run(tb.exec_argv(host, [SSHD, "-f", str(config), "-E", str(d / "sshd.log")]))
        pid = _wait_pidfile(d / "sshd.pid")
        tb.pids.setdefault(host.name, []).append(pid)
        tb.made.append(f"sshd {host.name} pid {pid}")
        tb.save()
    say(f"sshd on every host (port 22, user root, key {tb.ssh_key})")


def _wait_pidfile(path: Path, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            time.sleep(0.05)
    raise TestbedError(f"{path} did not appear within {timeout_s:g}s")
