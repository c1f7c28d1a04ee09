"""Video decoding, frame sampling and per-frame preprocessing (runtime/media/video.py) bit-exact against
transformers' Gemma4 video processing, on clips these tests write with PyAV, and the errors for unusable input.

HF's Gemma4VideoProcessor needs torchvision, whose wheels here are CUDA builds that do not load beside the CPU
torch; so the oracle is HF's own pieces (its PyAV loader and sampling, `get_aspect_ratio_preserving_size`,
`convert_video_to_patches`'s reshape) with the resize torchvision's `resize_image` runs for uint8 bicubic:
float32, `interpolate(bicubic, antialias=True)`, clamp, round, uint8."""

from __future__ import annotations

import io

import numpy as np
import pytest

from thorgen.model_spec.presets import get_preset
from thorgen.runtime.media.video import VideoError, frame_text, load_video, sample_indices
from thorgen.runtime.media.video_resize import resize_frames

from video_clips import clip

av = pytest.importorskip("av")
VISION = get_preset("tiny").vision


CLIPS = {
    "mp4": lambda: clip("mp4", "libx264", 12, 96, 64),
    "mov": lambda: clip("mov", "mpeg4", 7, 80, 120),
    "webm": lambda: clip("webm", "libvpx", 9, 64, 48),
    "gif": lambda: clip("gif", "gif", 5, 50, 40, pix="rgb8"),
}


def all_frames(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def hf_frame_patches(frames: np.ndarray, budget: int) -> tuple[np.ndarray, int]:
    """HF's per-frame pixel values [F, L, 768] (float32) and soft tokens for RGB frames [F, H, W, 3]."""
    torch = pytest.importorskip("torch")
    pil = pytest.importorskip("transformers.models.gemma4.image_processing_pil_gemma4")
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    p, k = VISION.patch_size, VISION.pooling_kernel_size
    th, tw = pil.get_aspect_ratio_preserving_size(video.shape[2], video.shape[3], p, budget * k * k, k)
    if (th, tw) != tuple(video.shape[2:]):
        x = torch.nn.functional.interpolate(video.float(), size=[th, tw], mode="bicubic", antialias=True)
        video = x.clamp_(0, 255).round_().to(torch.uint8)
    pixels = video.to(torch.float32) / torch.tensor(255.0)  # the processor's fused rescale (std 1 * 255)
    f, c, h, w = pixels.shape  # HF's convert_video_to_patches (its module needs torchvision to import)
    patches = pixels.reshape(f, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(f, (h // p) * (w // p), -1)
    return patches.numpy(), patches.shape[1] // (k * k)


@pytest.mark.parametrize("kind", sorted(CLIPS))
def test_frames_match_hf_processing(kind: str) -> None:
    data = CLIPS[kind]()
    assert len(data) < 64_000
    video = load_video(data, VISION, budget=70, num_frames=4)
    frames = all_frames(data)
    idx = sample_indices(len(frames), num_frames=4)
    assert len(video.frames) == len(idx) == 4
    want, soft = hf_frame_patches(np.stack([frames[i] for i in idx]), 70)
    for got, ref in zip(video.frames, want):
        assert got.soft_tokens == soft
        assert np.array_equal(got.pixel_values(), ref)
    assert video.timestamps == tuple(i / video.fps for i in idx)


def test_decode_and_sampling_match_hf_loader() -> None:
    vu = pytest.importorskip("transformers.video_utils")
    data = CLIPS["mp4"]()
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        hf_frames, meta = vu.read_video_pyav(f.name, lambda metadata, **_: vu.default_sample_indices_fn(metadata, 5))
    video = load_video(data, VISION, num_frames=5)
    assert video.fps == meta.fps and video.total_frames == meta.total_num_frames
    assert list(video.timestamps) == list(meta.timestamps)
    want, _ = hf_frame_patches(np.asarray(hf_frames), 70)
    assert all(np.array_equal(a.pixel_values(), b) for a, b in zip(video.frames, want))


@pytest.mark.parametrize("budget", [70, 280])
def test_resize_matches_torch_on_odd_sizes(budget: int) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(budget)
    for h, w, th, tw in [(37, 53, 144, 192), (300, 500, 192, 336), (120, 200, 96, 144), (90, 33, 480, 96)]:
        frames = rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8)
        x = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous().float()
        ref = torch.nn.functional.interpolate(x, size=[th, tw], mode="bicubic", antialias=True)
        ref = ref.clamp_(0, 255).round_().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        assert np.array_equal(resize_frames(frames, th, tw), ref), (h, w, th, tw)


def test_sampling_defaults_and_limits() -> None:
    assert sample_indices(100).tolist() == [i * 100 // 32 for i in range(32)]  # at most 32 frames by default
    assert sample_indices(5).tolist() == [0, 1, 2, 3, 4]  # a short clip keeps every frame
    assert sample_indices(100, num_frames=4).tolist() == [0, 25, 50, 75]
    assert sample_indices(80, fps=2, video_fps=8.0).tolist() == [i * 80 // 20 for i in range(20)]
    assert len(sample_indices(10_000, fps=30, video_fps=30.0)) == 32
    with pytest.raises(VideoError, match="exclusive"):
        sample_indices(10, num_frames=2, fps=1)
    assert frame_text(0.0) == "00:00" and frame_text(75.5) == "01:15"


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (b"not a video at all" * 10, "not a video"),
        (lambda: CLIPS["mp4"]()[:300], ""),
    ],
)
def test_bad_input_is_a_video_error(data, message: str) -> None:
    blob = data() if callable(data) else data
    with pytest.raises(VideoError, match=message or None):
        load_video(blob, VISION)


def test_budget_is_checked() -> None:
    with pytest.raises(VideoError, match="one of"):
        load_video(CLIPS["gif"](), VISION, budget=100)


def test_limits_and_streams_without_usable_frames() -> None:
    from thorgen.runtime.media.video import VideoLimits

    data = CLIPS["mp4"]()  # 12 frames at 8 fps: 1.5 s
    with pytest.raises(VideoError, match="at most 1 s"):
        load_video(data, VISION, limits=VideoLimits(max_duration_s=1.0))
    with pytest.raises(VideoError, match="at most 100 are accepted"):
        load_video(data, VISION, limits=VideoLimits(max_bytes=100))
    assert len(load_video(data, VISION, limits=VideoLimits(max_duration_s=2.0)).frames) == 12
    with pytest.raises(VideoError, match="no frames"):  # a raw stream's header alone
        load_video(b"YUV4MPEG2 W64 H48 F4:1 Ip A0:0 C420jpeg\n", VISION)
    with pytest.raises(VideoError, match="pixels a frame"):
        load_video(b"YUV4MPEG2 W5000 H4000 F4:1 Ip A0:0 C420jpeg\n", VISION)
    unknown = bytearray(data)
    while (i := unknown.find(b"avc1")) >= 0:  # the codec's fourcc renamed: no decoder for it
        unknown[i : i + 4] = b"zzzz"
    with pytest.raises(VideoError, match="codec"):
        load_video(bytes(unknown), VISION)
