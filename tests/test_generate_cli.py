"""`thorgen generate` through click's CliRunner on the synthetic tiny checkpoint (reference backend)."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

from thorgen.cli import main
from thorgen.runtime.backend import SamplingParams
from thorgen.runtime.reference.backend import ReferenceBackend

BASE = ["generate", "--backend", "reference", "--max-tokens", "16", "--json"]


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_json_ids_plain_and_speculative_agree(tiny_checkpoint, tiny_ckpt) -> None:
    plain = run(*BASE, "--model", str(tiny_checkpoint), "--prompt-ids", "2,105,200,107")
    assert plain.exit_code == 0, plain.output
    out = json.loads(plain.output)
    stops = set(tiny_ckpt.generation_config["eos_token_id"])
    direct = ReferenceBackend(tiny_ckpt).generate([2, 105, 200, 107], 16, SamplingParams(), stop_ids=frozenset(stops))
    assert out["token_ids"] == direct.token_ids
    assert out["finish_reason"] == direct.finish_reason == "length"
    assert len(out["token_ids"]) == 16
    assert {"prefill_s", "decode_s"} <= set(out["timings"])
    spec = run(*BASE, "--model", str(tiny_checkpoint), "--prompt-ids", "2,105,200,107", "--speculative")
    assert spec.exit_code == 0, spec.output
    spec_out = json.loads(spec.output)
    assert spec_out["token_ids"] == out["token_ids"]
    # verify steps ran; the draft policy turns to plain steps once the random drafter's drafts keep missing
    assert spec_out["accepted_lengths"] and sum(spec_out["accepted_lengths"]) <= len(out["token_ids"]) - 1


def test_sampled_text_prompt_gets_bos(tiny_checkpoint, tiny_ckpt) -> None:
    from thorgen.runtime.text.tokenizer import Tokenizer

    args = [*BASE, "--model", str(tiny_checkpoint), "--temperature", "0.8", "--top-k", "20", "--seed", "3"]
    by_text = json.loads(run(*args, "--prompt", "The model answers").output)
    ids = [2] + Tokenizer.from_file(tiny_ckpt.tokenizer_path).encode("The model answers")
    by_ids = json.loads(run(*args, "--prompt-ids", ",".join(map(str, ids))).output)
    assert by_text["token_ids"] == by_ids["token_ids"]
    assert by_text["prompt_tokens"] == len(ids)


def test_text_output_and_errors(tiny_checkpoint, tmp_path) -> None:
    ok = CliRunner().invoke(
        main, ["generate", "--model", str(tiny_checkpoint), "--prompt-ids", "2,5,6", "--max-tokens", "4"]
    )
    assert ok.exit_code == 0 and "finish=" in ok.output
    cases = [
        (["--prompt-ids", "2,512"], "outside the vocabulary"),
        (["--prompt-ids", "2,abc"], "comma-separated"),
        ([], "exactly one of"),
        (["--prompt", "hi", "--prompt-ids", "2"], "exactly one of"),
        (["--prompt-ids", "2", "--kv-dtype", "fp8"], "needs --backend cuda"),
    ]
    if shutil.which("nvidia-smi") is None:  # no GPU: the cuda backend must point the user at the reference
        cases.append((["--prompt-ids", "2", "--backend", "cuda"], "--backend reference"))
    for extra, message in cases:
        r = CliRunner().invoke(main, ["generate", "--model", str(tiny_checkpoint), *extra])
        assert r.exit_code != 0 and message in r.output, (extra, r.output)
        assert r.exception is None or isinstance(r.exception, SystemExit)
    missing = CliRunner().invoke(main, ["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "2"])
    assert missing.exit_code != 0 and "does not exist" in missing.output
    empty = CliRunner().invoke(main, ["generate", "--model", str(tmp_path), "--prompt-ids", "2"])
    assert empty.exit_code != 0 and "config.json" in empty.output


def test_image_fills_the_prompts_placeholder(tiny_checkpoint, tiny_ckpt, tmp_path) -> None:
    import io

    import numpy as np
    from PIL import Image

    from thorgen.runtime.media.images import load_image
    from thorgen.runtime.media.prompts import expand_image_tokens
    from thorgen.runtime.text.tokenizer import Tokenizer

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)).save(buf, format="PNG")
    path = tmp_path / "photo.png"
    path.write_bytes(buf.getvalue())
    args = [*BASE, "--model", str(tiny_checkpoint), "--image", str(path), "--image-max-tokens", "70"]
    out = json.loads(run(*args, "--prompt", "Look: <|image|> What is it?").output)
    vision = tiny_ckpt.spec.vision
    ids = [2] + Tokenizer.from_file(tiny_ckpt.tokenizer_path).encode("Look: <|image|> What is it?")
    assert ids.count(vision.image_token_id) == 1
    expanded, spans = expand_image_tokens(ids, [load_image(path.read_bytes(), vision, 70)], vision)
    stops = frozenset(tiny_ckpt.generation_config["eos_token_id"])
    direct = ReferenceBackend(tiny_ckpt).generate(expanded, 16, SamplingParams(), stop_ids=stops, images=spans)
    assert out["prompt_tokens"] == len(expanded) and out["token_ids"] == direct.token_ids
    for prompt, message in (("no placeholder", "placeholder"), ("<|image|><|image|>", "placeholder")):
        r = CliRunner().invoke(main, [*args, "--prompt", prompt])
        assert r.exit_code != 0 and message in r.output and "--image" in r.output, r.output
    (tmp_path / "bad.png").write_bytes(b"not an image")
    r = CliRunner().invoke(
        main, [*BASE, "--model", str(tiny_checkpoint), "--image", str(tmp_path / "bad.png"), "--prompt", "<|image|>"]
    )
    assert r.exit_code != 0 and "bad.png" in r.output and "not an image" in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_video_fills_the_prompts_placeholder(tiny_checkpoint, tiny_ckpt, tmp_path) -> None:
    import pytest

    pytest.importorskip("av")
    from video_clips import mp4

    from thorgen.runtime.media.prompts import expand_image_tokens, expand_video_text, video_frames
    from thorgen.runtime.media.video import load_video
    from thorgen.runtime.text.tokenizer import Tokenizer

    path = tmp_path / "clip.mp4"
    path.write_bytes(mp4(frames=6))
    args = [*BASE, "--model", str(tiny_checkpoint), "--video", str(path), "--num-frames", "3"]
    prompt = "Watch: <|video|> What moves?"
    out = json.loads(run(*args, "--prompt", prompt).output)
    vision, tok = tiny_ckpt.spec.vision, Tokenizer.from_file(tiny_ckpt.tokenizer_path)
    video = load_video(path.read_bytes(), vision, 70, num_frames=3)
    ids = [2] + tok.encode(expand_video_text(prompt, [video], tok.id_to_token, vision))
    expanded, spans = expand_image_tokens(ids, [], vision, video_frames([video]))
    assert len(spans) == 3
    stops = frozenset(tiny_ckpt.generation_config["eos_token_id"])
    direct = ReferenceBackend(tiny_ckpt).generate(expanded, 16, SamplingParams(), stop_ids=stops, images=spans)
    assert out["prompt_tokens"] == len(expanded) and out["token_ids"] == direct.token_ids
    for extra, message in (
        (["--prompt", "no placeholder"], "video placeholder"),
        (["--prompt-ids", "2,3"], "--video needs --prompt"),
        (["--prompt", "<|video|>", "--fps", "1"], "--num-frames or --fps"),
    ):
        r = CliRunner().invoke(main, [*args, *extra])
        assert r.exit_code != 0 and message in r.output, r.output
    (tmp_path / "bad.mp4").write_bytes(b"not a video")
    r = CliRunner().invoke(
        main, [*BASE, "--model", str(tiny_checkpoint), "--video", str(tmp_path / "bad.mp4"), "--prompt", "<|video|>"]
    )
    assert r.exit_code != 0 and "bad.mp4" in r.output and "not a video" in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
