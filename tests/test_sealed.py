"""Sealed samples: envelope encryption, the capture rule, the contract field and the archive tables."""

from __future__ import annotations

import json

import pytest

from specwatch.archive.store import Archive
from specwatch.collectors.capture import SampleCapture
from specwatch.analysis.reproduce import ReproduceError, reproduce_decision
from specwatch.schemas import (BundleCard, Decision, PolicyError, RequestRecord, decode_line, encode_record,
                               load_policy)
from specwatch.schemas.otlp import decode_request, encode_records
from specwatch.schemas.policy import CapturePolicy
from specwatch.schemas.rerun import RerunOutcome
from specwatch.schemas.sealed import SampleKey, SealedSampleError, Sealer, open_sealed, sealed_key_id, token_digest

_SECRET = b"a sample key for tests, 32 bytes"
_KEY = SampleKey.from_secret(_SECRET)
_OTHER = SampleKey.from_secret(b"some other key of sixteen+ bytes")
_PROMPT, _OUTPUT = [17, 4, 2040, 9], [5, 5, 6, 7, 1999]


def _request(rid="r1", sealed=None, ts=100.0):
    sample = {"prompt_sha256": token_digest(_PROMPT), "output_sha256": token_digest(_OUTPUT),
              "sampling": {"temperature": 0.0, "top_p": 1.0, "seed": 7, "max_tokens": 5}}
    if sealed is not None:
        sample["sealed"] = sealed
    return RequestRecord.model_validate({
        "v": 1, "ts": ts, "worker": "w1", "bundle_id": "b-1", "id": rid, "bucket": "coding", "cohort": "main",
        "speculative": True, "ttft_ms": 5.0, "tpot_ms": 1.0, "e2e_ms": 9.0, "output_tokens": 5,
        "finish_reason": "length", "sample": sample})


def test_seal_and_open_round_trip_checks_digests():
    sealed = Sealer(_KEY).seal(_PROMPT, _OUTPUT, sample_id="r1")
    assert sealed_key_id(sealed) == _KEY.key_id
    opened = open_sealed(sealed, _KEY, token_digest(_PROMPT), token_digest(_OUTPUT), "r1")
    assert (list(opened.prompt_ids), list(opened.output_ids)) == (_PROMPT, _OUTPUT)
    with pytest.raises(SealedSampleError, match="output token ids do not match the record's output_sha256"):
        open_sealed(sealed, _KEY, token_digest(_PROMPT), token_digest(_OUTPUT[:-1]), "r1")


def test_one_data_key_per_batch():
    drawn = []

    def random_bytes(n: int) -> bytes:  # os.urandom, deterministic, and counting what was drawn
        drawn.append(n)
        return bytes([len(drawn)]) * n

    sealer = Sealer(_KEY, batch_samples=2, random_bytes=random_bytes)
    wrapped = [sealer.seal([i], [i], sample_id=f"r{i}").split(".")[2] for i in range(5)]
    assert wrapped[0] == wrapped[1] != wrapped[2] == wrapped[3] != wrapped[4]
    assert drawn.count(32) == 3  # data keys: samples 1-2, 3-4, 5
    assert drawn.count(12) == 5  # one nonce per sample


def test_wrong_key_missing_key_and_tampering_open_nothing():
    sealed = Sealer(_KEY).seal(_PROMPT, _OUTPUT, sample_id="r1")
    with pytest.raises(SealedSampleError) as wrong:
        open_sealed(sealed, _OTHER, None, None)
    assert str(wrong.value) == (f"the sample was sealed with key {_KEY.key_id} and the key given is "
                                f"{_OTHER.key_id}; set SPECWATCH_SAMPLE_KEY_FILE to the file of key {_KEY.key_id}")
    with pytest.raises(SealedSampleError, match=f"no sample key: set SPECWATCH_SAMPLE_KEY_FILE .* {_KEY.key_id}"):
        open_sealed(sealed, None, None, None)
    head, body = sealed.rsplit(".", 1)
    flipped = head + "." + body[:-2] + ("A" if body[-2] != "A" else "B") + body[-1]
    with pytest.raises(SealedSampleError, match="altered"):
        open_sealed(flipped, _KEY, None, None, "r1")
    forged_id = sealed.replace(_KEY.key_id, _OTHER.key_id)
    with pytest.raises(SealedSampleError, match="was altered, or its key id was forged"):
        open_sealed(forged_id, _OTHER, None, None, "r1")
    with pytest.raises(SealedSampleError, match="not a sealed sample"):
        sealed_key_id("sw1.nope")


def test_key_from_environment_never_shows_the_secret(tmp_path, caplog):
    path = tmp_path / "sample.key"
    path.write_bytes(_SECRET + b"\n")
    path.chmod(0o644)
    from_file = SampleKey.from_env({"SPECWATCH_SAMPLE_KEY_FILE": str(path), "SPECWATCH_SAMPLE_KEY": "ignored"})
    assert from_file == _KEY
    assert "sample key file" in caplog.text and "can be read by other users" in caplog.text
    assert _SECRET.decode() not in caplog.text
    caplog.clear()
    path.chmod(0o600)
    assert SampleKey.from_env({"SPECWATCH_SAMPLE_KEY_FILE": str(path)}) == _KEY and not caplog.text
    assert SampleKey.from_env({"SPECWATCH_SAMPLE_KEY": _SECRET.decode()}) == _KEY
    assert SampleKey.from_env({}) is None
    assert _SECRET.decode() not in repr(_KEY) and _KEY.kek.hex() not in repr(_KEY)
    with pytest.raises(ValueError, match="SPECWATCH_SAMPLE_KEY: a sample key must be 16 to 4096 bytes long, got 5"):
        SampleKey.from_env({"SPECWATCH_SAMPLE_KEY": "short"})
    with pytest.raises(ValueError, match="cannot read the sample key file: No such file"):
        SampleKey.from_env({"SPECWATCH_SAMPLE_KEY_FILE": str(tmp_path / "missing")})
    sealed = Sealer(_KEY).seal(_PROMPT, _OUTPUT, sample_id="r1")
    assert _SECRET.decode() not in sealed and "17" not in sealed.split(".")[1]


def test_capture_policy_is_off_by_default_and_validated(tmp_path):
    assert load_policy(None).capture == CapturePolicy(enabled=False, rate=0.01, buckets=[],
                                                      max_prompt_tokens=4096, max_output_tokens=4096)
    bad = tmp_path / "bad.toml"
    for text, problem in (("[capture]\nenabled = true\nrate = 1.5\n",
                           "capture.rate: Input should be less than or equal to 1"),
                          ("[capture]\nratio = 0.5\n", "capture.ratio: Extra inputs are not permitted")):
        bad.write_text(text)
        with pytest.raises(PolicyError, match=problem):
            load_policy(bad)
    assert SampleCapture.from_policy(CapturePolicy()) is None
    with pytest.raises(ValueError, match="capture is enabled but there is no sample key"):
        SampleCapture.from_policy(CapturePolicy(enabled=True), environ={})


def test_capture_takes_its_share_buckets_and_size_limits():
    capture = SampleCapture(CapturePolicy(enabled=True, rate=0.25, buckets=["coding"], max_prompt_tokens=4,
                                          max_output_tokens=5), _KEY)
    taken = [i for i in range(400) if capture.seal(f"req-{i}", "coding", _PROMPT, _OUTPUT) is not None]
    assert len(taken) == 95  # a digest of the id picks the same requests on every run
    assert taken == [i for i in range(400) if SampleCapture(capture.policy, _KEY).seal(
        f"req-{i}", "coding", _PROMPT, _OUTPUT) is not None]
    assert all(capture.seal(f"req-{i}", "chat", _PROMPT, _OUTPUT) is None for i in taken)
    assert all(capture.seal(f"req-{i}", "coding", _PROMPT + [1], _OUTPUT) is None for i in taken)
    stats = capture.stats()
    assert (stats.sealed, stats.too_long) == (95, 95)


def test_records_without_a_seal_keep_their_bytes_and_sealed_ones_travel():
    plain = _request()
    assert "sealed" not in encode_record(plain)
    assert json.loads(encode_record(plain))["sample"] == {
        "prompt_sha256": token_digest(_PROMPT), "output_sha256": token_digest(_OUTPUT),
        "sampling": {"temperature": 0.0, "top_p": 1.0, "seed": 7, "max_tokens": 5}}
    sealed = Sealer(_KEY).seal(_PROMPT, _OUTPUT, sample_id="r1")
    record = _request(sealed=sealed)
    assert decode_line(encode_record(record)) == record
    (decoded,) = decode_request(encode_records([record]))
    assert decoded == record and decoded.sample.sealed == sealed


def _archive_with_sealed_decision(tmp_path, environ=None):
    archive = Archive.open(f"chdb://{tmp_path}/archive", environ=environ or {})
    decision = Decision(ts=101.0, bundle_id="b-1", bucket="coding", action="disable_speculation",
                        reason="acceptance_drop", detector="acceptance_gate", sample_ids=["r1", "r2"])
    card = {"target": {"model_id": "/m/target"},
            "drafter": {"mechanism": "ngram", "revision": "ngram:lookup=2-3", "draft_length": 4}}
    sealed = Sealer(_KEY).seal(_PROMPT, _OUTPUT, sample_id="r1")
    archive.write_decision(decision, {"card": card}, [_request("r1", sealed), _request("r2")])
    return archive, decision, sealed


def test_archive_keeps_ciphertext_apart_and_sql_sees_only_ciphertext(tmp_path):
    archive, decision, sealed = _archive_with_sealed_decision(tmp_path)
    with archive:
        (row,) = archive.sealed_samples(decision.id)
        assert row == {"decision_id": decision.id, "sample_id": "r1", "ts": 100.0, "bundle_id": "b-1",
                       "key_id": _KEY.key_id, "prompt_sha256": token_digest(_PROMPT),
                       "output_sha256": token_digest(_OUTPUT), "sealed": sealed}
        samples = archive.samples(decision.id)
        assert [s["sample_id"] for s in samples] == ["r1", "r2"]
        assert all("sealed" not in s["record"]["sample"] for s in samples)
        columns, rows = archive.sql("SELECT * FROM specwatch.sealed_samples")
        text = json.dumps([list(map(str, r)) for r in rows])
        assert "sealed" in columns and sealed in text and "2040" not in text
        _, ttl = archive.sql("SELECT engine_full FROM system.tables WHERE name = 'sealed_samples'")
        assert "TTL archived_at + toIntervalDay(30)" in ttl[0][0]


def test_sealed_sample_retention_is_a_table_ttl(tmp_path):
    archive, decision, _ = _archive_with_sealed_decision(tmp_path)
    archive.close()
    with pytest.raises(ValueError, match="SPECWATCH_SEALED_SAMPLE_DAYS must be a whole number of days"):
        Archive.open(f"chdb://{tmp_path}/archive", environ={"SPECWATCH_SEALED_SAMPLE_DAYS": "soon"})
    with Archive.open(f"chdb://{tmp_path}/archive", environ={"SPECWATCH_SEALED_SAMPLE_DAYS": "7"}) as archive:
        _, ttl = archive.sql("SELECT engine_full FROM system.tables WHERE name = 'sealed_samples'")
        assert "TTL archived_at + toIntervalDay(7)" in ttl[0][0]
        archive._client.command("INSERT INTO specwatch.sealed_samples VALUES "
                                "('d-old', 'r9', 1.0, 'b-1', 'k-x', '', '', 'sw1.x', now() - INTERVAL 8 DAY)")
        archive._client.command("OPTIMIZE TABLE specwatch.sealed_samples FINAL")
        _, rows = archive.sql("SELECT decision_id FROM specwatch.sealed_samples ORDER BY decision_id")
        assert rows == [(decision.id,)]


class _Runner:
    """An in-memory engine for the reproduce flow: fixed card and outputs, counts its runs."""

    def __init__(self, card, outcomes):
        self._card, self._outcomes, self.runs = card, outcomes, 0

    def card(self):
        return self._card

    def run(self, requests):
        self.runs += 1
        return self._outcomes[:len(requests)]


def test_reproduce_flow_audits_refuses_and_archives(tmp_path):
    archive, decision, _ = _archive_with_sealed_decision(tmp_path)
    with archive:
        card = BundleCard.model_validate(archive.decision(decision.id)["audit"]["card"])
        clock = iter(range(1000, 2000)).__next__
        outcome = RerunOutcome(standard_ids=[5, 5, 6, 8, 8], speculative_ids=list(_OUTPUT),
                               rounds=[(4, 1), (4, 0), (0, 0)], draft_ms=2.0, verify_ms=6.0)
        runner = _Runner(card, [outcome])
        for key, message in ((None, "no sample key"), (_OTHER, f"sealed with key {_KEY.key_id}")):
            with pytest.raises(ReproduceError, match=message) as refused:
                reproduce_decision(archive, decision.id, key, runner, "ops", clock)
            assert refused.value.exit_code == 3
        assert runner.runs == 0
        other_card = card.model_copy(update={"drafter": card.drafter.model_copy(update={"draft_length": 2})})
        with pytest.raises(ReproduceError, match="differs from the decision's in drafter.draft_length; nothing"):
            reproduce_decision(archive, decision.id, _KEY, _Runner(other_card, [outcome]), "ops", clock)
        result = reproduce_decision(archive, decision.id, _KEY, runner, "ops", clock)
        (report,) = result["requests"]
        assert (report["verdict"], report["identical"], report["first_divergence"],
                report["archived_vs_speculative"]) == ("reproduced", False, 3, None)
        assert report["position_acceptance"] == [0.5, 0.0, 0.0, 0.0]
        assert (report["drafted"], report["accepted"], report["draft_ms"], report["verify_ms"]) == (8, 1, 2.0, 6.0)
        forced = reproduce_decision(archive, decision.id, _KEY, _Runner(other_card, [outcome]), "ops", clock,
                                    force=True)
        assert forced["verdict"] == "bundle differs" and forced["card_differences"] == ["drafter.draft_length"]
        opens = archive.audit(kind="sample_open")
        assert [(a["actor"], a["decision_id"], a["detail"]["outcome"], a["detail"]["key_id"]) for a in opens] == [
            ("ops", decision.id, "refused", None), ("ops", decision.id, "refused", _OTHER.key_id),
            ("ops", decision.id, "opened", _KEY.key_id), ("ops", decision.id, "opened", _KEY.key_id),
            ("ops", decision.id, "opened", _KEY.key_id)]
        assert [r["verdict"] for r in archive.reproductions(decision.id)] == ["reproduced", "bundle differs"]


def test_explain_page_links_to_the_archived_reproduction(tmp_path):
    from specwatch.analysis.postmortem import render_html
    archive, decision, _ = _archive_with_sealed_decision(tmp_path)
    with archive:
        card = BundleCard.model_validate(archive.decision(decision.id)["audit"]["card"])
        outcome = RerunOutcome(standard_ids=list(_OUTPUT), speculative_ids=list(_OUTPUT), rounds=[(4, 4)])
        result = reproduce_decision(archive, decision.id, _KEY, _Runner(card, [outcome]), "ops", lambda: 5.0)
        page = render_html(archive.decision(decision.id), archive.samples(decision.id),
                           archive.reproductions(decision.id))
    ident = result["reproduction_id"]
    assert f'<a href="#{ident}">{ident} (reproduced)</a>' in page
    assert f'<tr id="{ident}" data-verdict="reproduced">' in page
    assert "r1: reproduced, first divergence -, acceptance by position 1 1 1 1" in page


def test_simulator_capture_seals_only_what_it_takes():
    from specwatch.lab.simulation.simulator import Simulator

    plain = list(Simulator("healthy", seed=3, minutes=0.3).records())
    capture = SampleCapture(CapturePolicy(enabled=True, rate=0.05), _KEY)
    captured = list(Simulator("healthy", seed=3, minutes=0.3, capture=capture).records())
    assert len(plain) == len(captured)
    changed = [(a, b) for a, b in zip(plain, captured) if a != b]
    stats = capture.stats()
    assert len(changed) == stats.sealed > 0 and stats.too_long > 0
    for before, after in changed:
        assert before.model_copy(update={"sample": None}) == after.model_copy(update={"sample": None})
        opened = open_sealed(after.sample.sealed, _KEY, after.sample.prompt_sha256, after.sample.output_sha256,
                             after.id)
        assert len(opened.output_ids) == after.output_tokens
        assert after.sample.sampling == before.sample.sampling


def _sw1(prompt_ids, output_ids) -> str:
    """A sample as sealed before samples were bound to their ids (format sw1): AES-GCM under a
    wrapped data key, with the version and key id alone as associated data."""
    import base64
    import struct

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.keywrap import aes_key_wrap

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    data_key, nonce = bytes(range(32)), bytes(range(12))
    clear = struct.pack(f"<I{len(prompt_ids) + len(output_ids)}I", len(prompt_ids), *prompt_ids, *output_ids)
    body = AESGCM(data_key).encrypt(nonce, clear, f"sw1.{_KEY.key_id}".encode())
    return f"sw1.{_KEY.key_id}.{b64(aes_key_wrap(_KEY.kek, data_key))}.{b64(nonce + body)}"


def test_a_ciphertext_opens_only_as_the_sample_it_was_sealed_for():
    sealed = Sealer(_KEY).seal(_PROMPT, _OUTPUT, sample_id="r1")
    assert open_sealed(sealed, _KEY, None, None, "r1").bound
    with pytest.raises(SealedSampleError) as moved:
        open_sealed(sealed, _KEY, token_digest(_PROMPT), token_digest(_OUTPUT), "r2")
    assert str(moved.value) == (f"the sealed sample does not open as sample 'r2' with key {_KEY.key_id}: it "
                                "belongs to another sample, was altered, or its key id was forged")
    with pytest.raises(SealedSampleError, match="opens only with the id of its sample"):
        open_sealed(sealed, _KEY, None, None)
    downgraded = "sw1." + sealed.split(".", 1)[1]  # claiming the unbound format does not help
    with pytest.raises(SealedSampleError, match="was altered or its key id was forged"):
        open_sealed(downgraded, _KEY, None, None, "r2")


def test_samples_sealed_before_the_binding_still_open_and_say_so():
    old = _sw1(_PROMPT, _OUTPUT)
    opened = open_sealed(old, _KEY, token_digest(_PROMPT), token_digest(_OUTPUT), "any id")
    assert (list(opened.prompt_ids), list(opened.output_ids), opened.bound) == (_PROMPT, _OUTPUT, False)
    with pytest.raises(SealedSampleError, match="do not match the record's output_sha256"):
        open_sealed(old, _KEY, token_digest(_PROMPT), token_digest(_PROMPT), "any id")


def test_reproduce_refuses_a_row_copied_from_another_sample_or_decision(tmp_path):
    archive, decision, sealed = _archive_with_sealed_decision(tmp_path)
    with archive:
        card = BundleCard.model_validate(archive.decision(decision.id)["audit"]["card"])
        outcome = RerunOutcome(standard_ids=list(_OUTPUT), speculative_ids=list(_OUTPUT), rounds=[(4, 4)])
        # r1's ciphertext, digests and all, copied onto r2's row of the same decision
        archive._client.command(
            "INSERT INTO specwatch.sealed_samples (decision_id, sample_id, ts, bundle_id, key_id, prompt_sha256, "
            f"output_sha256, sealed) VALUES ('{decision.id}', 'r2', 100.0, 'b-1', '{_KEY.key_id}', "
            f"'{token_digest(_PROMPT)}', '{token_digest(_OUTPUT)}', '{sealed}')")
        runner = _Runner(card, [outcome, outcome])
        with pytest.raises(ReproduceError) as moved:
            reproduce_decision(archive, decision.id, _KEY, runner, "ops", lambda: 5.0)
        assert str(moved.value) == (f"cannot open the samples of {decision.id}: the sealed sample does not open "
                                    f"as sample 'r2' with key {_KEY.key_id}: it belongs to another sample, was "
                                    "altered, or its key id was forged")
        # the whole row of r1 copied under a decision that never named r1
        other = Decision(ts=102.0, bundle_id="b-1", bucket="coding", action="disable_speculation",
                         reason="acceptance_drop", detector="acceptance_gate", sample_ids=["r7"])
        archive.write_decision(other, {"card": card.model_dump(mode="json")}, [_request("r7")])
        archive._client.command(
            "INSERT INTO specwatch.sealed_samples (decision_id, sample_id, ts, bundle_id, key_id, prompt_sha256, "
            f"output_sha256, sealed) VALUES ('{other.id}', 'r1', 100.0, 'b-1', '{_KEY.key_id}', "
            f"'{token_digest(_PROMPT)}', '{token_digest(_OUTPUT)}', '{sealed}')")
        with pytest.raises(ReproduceError, match=f"sealed sample 'r1' is archived under {other.id} but the "
                                                 "decision does not name it among its samples"):
            reproduce_decision(archive, other.id, _KEY, runner, "ops", lambda: 6.0)
        assert runner.runs == 0
        assert [a["detail"]["outcome"] for a in archive.audit(kind="sample_open")] == ["refused", "refused"]


def test_an_empty_sample_key_setting_is_an_error_like_an_empty_signing_key():
    for name in ("SPECWATCH_SAMPLE_KEY", "SPECWATCH_SAMPLE_KEY_FILE"):
        for empty in ("", "  "):
            with pytest.raises(ValueError) as refused:
                SampleKey.from_env({name: empty})
            assert str(refused.value).startswith(f"{name} is set but empty: give it the key")
