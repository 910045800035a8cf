"""Constants and helpers shared by the Hub and remote tests."""

from __future__ import annotations

import os

from tests.hub.fakehub import FakeHub

__all__ = ["TOKEN", "USER", "remote_wired", "subprocess_env"]

TOKEN = "hf_fakeTestToken0123456789abcdefXYZ"
USER = "alice"


def subprocess_env(hub: FakeHub, home: str, *, token: bool = True) -> dict[str, str]:
    """Environment for a child process that reaches the fake Hub through the libraries' own settings
    (HF_ENDPOINT, HF_TOKEN, HF_HOME): nothing in the child is patched."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=home, HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               HF_HUB_DISABLE_UPDATE_CHECK="1", HF_DATASETS_CACHE=os.path.join(home, "datasets"))
    if token:
        env["HF_TOKEN"] = TOKEN
    return env


def remote_wired() -> bool:
    """Whether remote roots read through hiddenstates.hub.remote.RemoteFS (the Root.fs wiring)."""
    from hiddenstates.h5store.root import Root
    from hiddenstates.hub.remote import RemoteFS

    return isinstance(Root("memory://hiddenstates-wiring-probe").fs, RemoteFS)
