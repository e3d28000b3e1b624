"""weights/manifest.json: every entry names a zoo model, a licence and a well-formed sha256."""

import json
import re
from pathlib import Path

import dpzoo

MANIFEST = Path(__file__).resolve().parents[1] / "weights" / "manifest.json"


def test_manifest_entries_are_well_formed():
    entries = json.loads(MANIFEST.read_text())["weights"]
    ids = [e["id"] for e in entries]
    assert len(ids) == len(set(ids))
    for e in entries:
        assert dpzoo.is_model(e["zoo_entry"]), e
        assert e["licence"] and e["source"] and e["format"]
        assert e["sha256"] is None or re.fullmatch(r"[0-9a-f]{64}", e["sha256"]), e


def test_every_pretrained_tag_has_a_manifest_entry():
    entries = json.loads(MANIFEST.read_text())["weights"]
    covered = {e["zoo_entry"] for e in entries}
    assert set(dpzoo.list_models(pretrained=True)) <= covered
