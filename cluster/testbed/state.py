"""The testbed's record: what was made and where things are, kept in `<state dir>/state.json`.

Everything made is recorded in the state file before or as it is made (namespaces with their nsfs
inode, links, pids), so `down` removes every namespace, link and process it made, also after a
failed or killed `up`; `up` first runs `down` for its own prefix and also removes leftovers of
that prefix found by name (`ip netns list`, `ip link`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

from cluster.testbed.plan import _SYS_PATH, DASHBOARD_PORT, GCS_PORT, HTTP_PORT, REDIS_PORT, Host

_State = TypeVar("_State", bound="TestbedState")


@dataclass
class TestbedState:
    """The record (the state file's content) and the addresses and paths that follow from it;
    `Testbed` (cluster/testbed/control.py) adds what one does with a testbed that is up."""

    prefix: str
    subnet: str
    state_dir: str
    rate: str
    venv: str
    hosts: list[Host]
    bridge: str
    sshd: bool = False
    ray: bool = True
    pids: dict[str, list[int]] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)  # what up made, in order (for the record)
    phase: str = "creating"

    # -- where things are
    @property
    def bridge_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def head(self) -> Host:
        return next(h for h in self.hosts if h.role == "head")

    def role(self, role: str) -> list[Host]:
        return [h for h in self.hosts if h.role == role]

    def host(self, name_or_ip: str) -> Host:
        for h in self.hosts:
            if name_or_ip in (h.name, h.ip):
                return h
        raise KeyError(name_or_ip)

    @property
    def gcs_address(self) -> str:
        return f"{self.head.ip}:{GCS_PORT}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.head.ip}:{REDIS_PORT}/0"

    @property
    def http_url(self) -> str:
        return f"http://{self.head.ip}:{HTTP_PORT}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.head.ip}:{DASHBOARD_PORT}"

    @property
    def home(self) -> Path:
        return Path(self.state_dir) / "home"

    @property
    def bin_dir(self) -> Path:
        return Path(self.state_dir) / "bin"

    @property
    def ssh_dir(self) -> Path:
        return Path(self.state_dir) / "ssh"

    @property
    def ssh_key(self) -> Path:
        return self.ssh_dir / "id_ed25519"

    def host_dir(self, host: Host) -> Path:
        return Path(self.state_dir) / "hosts" / host.name

    def ray_temp_dir(self, host: Host) -> Path:
        return Path(self.state_dir) / "ray" / host.ip  # as testbed.yaml's --temp-dir

    @property
    def state_file(self) -> Path:
        return Path(self.state_dir) / "state.json"

    def env(self) -> dict[str, str]:
        """The environment of every command run on a host (the same as an ssh session's)."""
        return {
            "HOME": str(self.home),
            "PATH": f"{self.bin_dir}:{self.venv}/bin:{_SYS_PATH}",
            "PDTB_DIR": self.state_dir,
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "RAY_HEAD_IP": self.head.ip,
            "RAY_ADDRESS": self.gcs_address,
            "TOKENIZERS_PARALLELISM": "false",
        }

    # -- state file
    def save(self) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(self.state_file)

    @classmethod
    def load(cls: type[_State], state_dir: str) -> _State | None:
        path = Path(state_dir) / "state.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        data["hosts"] = [Host(**h) for h in data["hosts"]]
        return cls(**data)
