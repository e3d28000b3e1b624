"""Offline, a pretrained load fails in one probe, not after the hub client's retries; weights in
the local cache would still load (offline mode, not a refusal); the user's own offline setting
is left alone."""

from __future__ import annotations

import time

import pytest
from huggingface_hub import constants

import dpzoo
from dpzoo.models import hub_reach


def test_unreachable_endpoint_is_seen_in_one_probe(monkeypatch):
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: closed
    t0 = time.monotonic()
    assert hub_reach.hub_reachable() is False
    assert time.monotonic() - t0 < hub_reach.PROBE_TIMEOUT_S + 1


def test_offline_mode_only_inside_the_block_and_only_when_unreachable(monkeypatch):
    monkeypatch.setattr(hub_reach, "hub_reachable", lambda timeout=None: False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with hub_reach.offline_unless_reachable() as online:
        assert online is False and constants.is_offline_mode()
    assert constants.HF_HUB_OFFLINE is False
    monkeypatch.setattr(hub_reach, "hub_reachable", lambda timeout=None: True)
    with hub_reach.offline_unless_reachable() as online:
        assert online is True and not constants.is_offline_mode()


def test_users_offline_setting_is_left_alone(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_reach, "hub_reachable", lambda timeout=None: pytest.fail("no probe when offline is set"))
    with hub_reach.offline_unless_reachable() as online:
        assert online is False
    assert constants.HF_HUB_OFFLINE is True


@pytest.mark.parametrize("name", ["resnet18-gn-bias", "gpt2"])
def test_pretrained_load_offline_fails_fast_with_the_one_line_message(monkeypatch, name):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as a user's session is (the suite sets it)
    monkeypatch.setattr(hub_reach, "hub_reachable", lambda timeout=None: False)
    t0 = time.monotonic()
    with pytest.raises(dpzoo.errors.CheckpointError, match="Offline\\?") as info:
        dpzoo.load(name, pretrained=True)
    assert time.monotonic() - t0 < 20  # the hub client's retries took about 50 s
    assert "\n" not in str(info.value)
    assert constants.HF_HUB_OFFLINE is False
