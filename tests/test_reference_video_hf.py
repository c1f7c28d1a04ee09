"""A video's prompt layout and the reference language model with a video vs HF transformers on the synthetic tiny
checkpoint: the chat template's `<|video|>` expanded into the frames' `mm:ss <|image>` + N x `<|video|>` +
`<image|>` layout exactly as HF's Gemma4Processor writes and tokenizes it, and the reference logits against
Gemma4ForConditionalGeneration fed the frames as `pixel_values_videos` with mm_token_type_ids 2 (each frame its
own bidirectional block on the sliding layers; frames longer than the window, 16)."""

from __future__ import annotations

import numpy as np
import pytest

from thorgen.runtime.media.prompts import expand_image_tokens, expand_video_text, video_frames
from thorgen.runtime.media.video import load_video
from thorgen.runtime.text.tokenizer import Tokenizer
from thorgen.serve.chat_template import ChatTemplate

pytest.importorskip("av")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_reference_vision_hf import TOL, hf_model, ours_logits, rel  # noqa: E402  (the image oracle's pieces)
from video_clips import mp4  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
__all__ = ["hf_model"]  # the fixture, shared with the image oracle

MESSAGES = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "What happens?"}, {"type": "video"}, {"type": "text", "text": "Say."}],
    }
]


@pytest.fixture(scope="module")
def video(tiny_ckpt):
    # 6 frames at 4 fps: timestamps 00:00 .. 00:01; 64x48 frames at budget 70 -> 63 soft tokens each (> window 16)
    return load_video(mp4(frames=6), tiny_ckpt.spec.vision, budget=70, num_frames=3)


def hf_prompt(tiny_checkpoint, video) -> tuple[str, list[int]]:
    """The prompt as HF renders it: the template through the tokenizer's apply_chat_template, each `<|video|>`
    replaced by Gemma4Processor.replace_video_token through ProcessorMixin.get_text_with_replacements."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.video_utils import VideoMetadata

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny_checkpoint / "tokenizer.json"))
    source = (tiny_checkpoint / "chat_template.jinja").read_text()
    text = tok.apply_chat_template(
        MESSAGES, chat_template=source, tokenize=False, add_generation_prompt=True, bos_token="<bos>"
    )
    processor = object.__new__(Gemma4Processor)  # its tokens only: the video processor needs torchvision
    processor.__dict__.update(
        boi_token="<|image>", eoi_token="<image|>", image_token="<|image|>", video_token="<|video|>", audio_token=None
    )
    indices = [round(t * video.fps) for t in video.timestamps]
    metadata = VideoMetadata(total_num_frames=video.total_frames, fps=video.fps, frames_indices=indices)
    inputs = {"num_soft_tokens_per_video": [video.frames[0].soft_tokens], "video_metadata": [metadata]}
    replacement = Gemma4Processor.replace_video_token(processor, inputs, 0)
    (expanded,), _ = Gemma4Processor.get_text_with_replacements(processor, [text], videos_replacements=[replacement])
    return expanded, tok(expanded, add_special_tokens=False)["input_ids"]


def ours(tiny_checkpoint, tiny_ckpt, video):
    vision = tiny_ckpt.spec.vision
    tokenizer = Tokenizer.from_checkpoint(tiny_checkpoint)
    template = ChatTemplate((tiny_checkpoint / "chat_template.jinja").read_text())
    text = expand_video_text(template.render(MESSAGES), [video], tokenizer.id_to_token, vision)
    ids, spans = expand_image_tokens(tokenizer.encode(text), [], vision, video_frames([video]))
    return text, ids, spans


def test_video_prompt_matches_hf_processor(tiny_checkpoint, tiny_ckpt, video) -> None:
    text, ids, spans = ours(tiny_checkpoint, tiny_ckpt, video)
    want_text, want_ids = hf_prompt(tiny_checkpoint, video)
    assert "00:00 <|image><|video|>" in want_text and "<image|> 00:01 <|image>" in want_text
    vision = tiny_ckpt.spec.vision
    n = video.frames[0].soft_tokens
    assert ids == want_ids
    assert want_ids.count(vision.video_token_id) == 3 * n and len(spans) == 3
    assert all(ids[s.offset - 1] == vision.boi_token_id and ids[s.end] == vision.eoi_token_id for s in spans)
    assert text.replace("<|video|>", "<|video|>" * n) == want_text


def test_logits_with_video_match_hf(tiny_checkpoint, tiny_ckpt, hf_model, video) -> None:
    _, ids, spans = ours(tiny_checkpoint, tiny_ckpt, video)
    assert all(s.image.soft_tokens > tiny_ckpt.spec.target.sliding_window for s in spans)
    vision = tiny_ckpt.spec.vision
    kinds = np.where(np.asarray(ids) == vision.video_token_id, 2, 0)  # HF's mm_token_type_ids for video tokens
    frames = [s.image for s in spans]
    pv = torch.from_numpy(np.stack([f.pixel_values() for f in frames]))
    pos = torch.from_numpy(np.stack([f.positions for f in frames]).astype(np.int64))
    with torch.no_grad():
        theirs = (
            hf_model(
                input_ids=torch.tensor([ids]),
                pixel_values_videos=pv,
                video_position_ids=pos,
                num_frames_per_video=torch.tensor([len(frames)]),
                mm_token_type_ids=torch.from_numpy(kinds)[None],
            )
            .logits[0]
            .numpy()
        )
    got = ours_logits(tiny_ckpt, ids, spans)
    err = rel(got, theirs)
    print(f"\nreference with a 3-frame video vs HF Gemma4ForConditionalGeneration: rel err {err:.3e}")
    assert err <= TOL
    cuts = [spans[1].offset, spans[2].offset, len(ids)]  # chunks ending at frame boundaries: the same logits
    assert rel(ours_logits(tiny_ckpt, ids, spans, cuts), theirs) <= TOL
