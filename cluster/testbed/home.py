"""The testbed's home: the HOME every command on a host runs with, and the wrappers on its PATH.

Every host shares this machine's filesystem: a model directory under /tmp serves every host.
Commands run with HOME=<state dir>/home (never root's home), whose .bashrc puts this venv on PATH
in front of a `ray` wrapper whose `ray stop` stops only the calling host's Ray (the real `ray stop`
stops every Ray process on the machine).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.testbed.control import Testbed


def _write_files(tb: Testbed) -> None:
    for d in (tb.home, tb.bin_dir, tb.ssh_dir, *(tb.host_dir(h) for h in tb.hosts)):
        d.mkdir(parents=True, exist_ok=True)
    bashrc = (
        f"export PDTB_DIR={shlex.quote(tb.state_dir)}\n"
        f"export PATH={shlex.quote(str(tb.bin_dir))}:{shlex.quote(tb.venv)}/bin:$PATH\n"
        "export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false LANG=C.UTF-8\n"
        # `ray status`, `serve status`, drivers: this cluster, not another Ray on the machine
        f"export RAY_ADDRESS={tb.gcs_address}\n"
    )
    (tb.home / ".bashrc").write_text(bashrc)
    (tb.home / ".bash_profile").write_text(". ~/.bashrc\n")
    (tb.home / ".profile").write_text(". ~/.bashrc\n")
    for stale in ("ray_bootstrap_config.yaml", "ray_bootstrap_key.pem"):  # a testbed start has no autoscaler
        (tb.home / stale).unlink(missing_ok=True)
    python = Path(tb.venv) / "bin" / "python"
    wrapper = tb.bin_dir / "ray"
    wrapper.write_text(
        "#!/bin/sh\n"
        "# `ray` on a testbed host. The real `ray stop` stops every Ray process of the machine (all\n"
        "# testbed hosts and any other Ray here): on a testbed host it stops this host's Ray only.\n"
        f'if [ "$1" = stop ]; then exec {shlex.quote(str(python))} -m cluster.testbed stop-host '
        f"--state-dir {shlex.quote(tb.state_dir)}; fi\n"
        f'exec {shlex.quote(tb.venv)}/bin/ray "$@"\n'
    )
    wrapper.chmod(0o755)
    ssh = tb.bin_dir / "ssh"
    ssh.write_text(
        "#!/bin/bash\n"
        "# `ssh` on testbed hosts. ssh expands `~` in `-i ~/ray_bootstrap_key.pem` (the head's autoscaler\n"
        "# reaching the workers) from the passwd entry, root's home, while testbed sessions keep their\n"
        "# files in $HOME, the testbed's home: point such arguments there.\n"
        "args=()\n"
        'for a in "$@"; do [[ $a == "~/"* ]] && a="$HOME/${a#\\~/}"; args+=("$a"); done\n'
        'exec /usr/bin/ssh "${args[@]}"\n'
    )
    ssh.chmod(0o755)
    session = tb.bin_dir / "session"
    session.write_text(
        "#!/bin/sh\n"
        "# sshd's ForceCommand on testbed hosts: every session gets the testbed's HOME (never root's).\n"
        f"export HOME={shlex.quote(str(tb.home))}\n"
        'cd "$HOME"\n'
        'if [ -z "$SSH_ORIGINAL_COMMAND" ]; then exec bash --login; fi\n'
        'exec bash -c "$SSH_ORIGINAL_COMMAND"\n'
    )
    session.chmod(0o755)
