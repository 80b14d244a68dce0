"""The workflow's secret key (dpmerge.keys, docs/design.md#security) and what is published with
it (dpmerge.publication): where the key comes from, bad keys refused in one line, domain
separation, keyed dataset identifiers and lineages, fixed-seed detection, Ed25519 signatures."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
from factories import make_record

from dpmerge import manifests
from dpmerge.keys import KEY_ENV, KEY_FILE_ENV, SecretKeyError, WorkflowKey
from dpmerge.publication import dataset_id, fixed_seed_streams, lineage_id, public_record
from dpmerge.vocabulary import KeyPurpose

FINGERPRINT = "digits-sha256:" + "ab" * 16


@pytest.fixture
def no_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    monkeypatch.setenv("DPMERGE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_the_default_key_is_generated_once_private_and_shared(no_key: Path) -> None:
    keys: list[WorkflowKey] = []
    start = threading.Barrier(4)

    def load() -> None:
        start.wait()
        keys.append(WorkflowKey.from_env())

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    path = no_key / "secret.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len({k.material for k in keys}) == 1 and len(keys[0].material) == 32
    assert WorkflowKey.from_env().material == keys[0].material  # reused, never replaced
    assert keys[0].source == str(path) and keys[0].material.hex() not in repr(keys[0])
    assert [p.name for p in no_key.iterdir()] == ["secret.key"]  # no staging file left


def test_the_environment_wins_and_bad_keys_are_one_line_errors(
    no_key: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(KEY_ENV, "11" * 32)
    assert WorkflowKey.from_env().material == bytes.fromhex("11" * 32)
    assert not no_key.exists()  # nothing generated
    bad = {"not hex": "not hexadecimal", "ab" * 31: "holds 31 bytes", "": None, "zz" * 40: "hex"}
    accepted = 0
    for value, message in bad.items():
        monkeypatch.setenv(KEY_ENV, value)
        if message is None:  # empty means unset: the home's key
            WorkflowKey.from_env()
            continue
        try:
            WorkflowKey.from_env()
            accepted += 1
        except SecretKeyError as error:
            assert message in str(error) and "\n" not in str(error)
    assert accepted == 0
    monkeypatch.delenv(KEY_ENV)
    key_file = tmp_path / "key"
    key_file.write_text("22" * 32)
    key_file.chmod(0o644)
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    with pytest.raises(SecretKeyError, match=f"readable by others.*chmod 600 {key_file}"):
        WorkflowKey.from_env()
    key_file.chmod(0o600)
    assert WorkflowKey.from_env().material == bytes.fromhex("22" * 32)
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(SecretKeyError, match="cannot read"):
        WorkflowKey.from_env()


def test_purposes_are_separated_and_identifiers_keyed() -> None:
    key, other = WorkflowKey.generate(), WorkflowKey.generate()
    macs = {key.mac(p, b"message") for p in KeyPurpose}
    assert len(macs) == len(KeyPurpose)  # one sub-key per purpose
    public = dataset_id(FINGERPRINT, key)
    assert public.startswith("digits-hmac:") and "ab" * 16 not in public
    assert public == dataset_id(FINGERPRINT, key) != dataset_id(FINGERPRINT, other)
    assert dataset_id(public, key) == public  # an identifier passes through
    assert lineage_id("noise-seed-7", key) == lineage_id("noise-seed-7", key)
    assert lineage_id("noise-seed-7", key) != lineage_id("noise-seed-8", key)
    assert key.key_id != other.key_id and len(key.key_id) == 12


def test_public_records_keep_the_numbers_and_hide_seeds_and_fingerprints() -> None:
    key = WorkflowKey.generate()
    fixed = make_record(
        "a",
        1.0,
        noise_lineage="noise-seed-7",
        batch_lineage="poisson-seed-7/n-9/q-0.1",
        dataset=FINGERPRINT,
        run_id="run-1",
    )
    assert fixed_seed_streams(fixed) == ("noise", "batches")
    assert fixed_seed_streams(make_record("b", 1.0)) == ()
    public = public_record(fixed, key)
    text = public.model_dump_json()
    assert "seed" not in text.replace("seed-0", "") and "ab" * 16 not in text
    assert (public.noise_multiplier, public.steps, public.sample_rate) == (
        1.0,
        2350,
        fixed.sample_rate,
    )
    assert public.run_id == lineage_id("run-1", key)


def test_signatures_bind_the_manifest_and_the_key() -> None:
    """A version's Ed25519 signature (derived from the workflow key) verifies with the public
    key alone, and only for the manifest it signed."""
    key, other = WorkflowKey.generate(), WorkflowKey.generate()
    manifest = manifests.Manifest(
        model="m",
        logged_model="m-1",
        release="c" * 64,
        facts={"dp.epsilon": "1.5"},
        files={"MLmodel": "0" * 64},
        card_digest="",
    )
    text, signed = manifests.sign(manifest, key)
    public = manifests.public_key_hex(key)
    assert manifests.verify(text, signed, public).release == "c" * 64
    assert manifests.public_key_hex(key) == public  # derived, stable
    assert manifests.verify(text, signed, public).key == manifests.fingerprint(public)
    changed = text.replace("1.5", "0.5")  # a fact edited after signing
    for bad_text, bad_sig, bad_key in (
        (changed, signed, public),
        (text, signed, manifests.public_key_hex(other)),  # another key
        (text, None, public),
        (None, signed, public),
    ):
        with pytest.raises(manifests.ReleaseSignatureError):
            manifests.verify(bad_text, bad_sig, bad_key)
    with pytest.raises(manifests.ReleaseSignatureError, match="differ"):
        manifests.check_facts(manifests.Manifest.parse(text), {"dp.epsilon": "0.5"})
    assert os.environ.get(KEY_ENV)  # the test session's key (conftest), not a repository file
