"""Every input a user names, checked before any step folder or lease exists.

Owns the up-front checks of a run: the prompt files `prompts.path` names exist and are of a type
tokenize reads (a chat template where prompts ask for one), `model.path` is a
checkpoint we can run (engine/checkpoint.py, headers only) whose tokenizer loads (where tokenize runs), a prompt of `max_prompt_tokens` plus
`max_new_tokens` fits the checkpoint's positions, the stop token ids are the checkpoint's, the
engine settings fit this host's devices, `run.root` can be written, and an online W&B
run has a key. Each failure is a ConfigError naming the key (exit 2), and nothing is written: a
check of `run.root` on remote storage writes a probe object and removes it, a local one asks the
operating system, then makes the root folder once every other check has passed. It refuses to check what only the step can see (the rows of a prompt file).
Only the inputs of steps that are about to run are checked (`pipeline run upload` needs no model):
the runner calls this once, with the steps its plan runs, before any step folder or lease.

    check_inputs(cfg, steps={"tokenize", "generate", "merge", "upload"}, is_leader=hosts.is_leader())
"""

from __future__ import annotations

import netrc
import os
import secrets
from urllib.parse import urlparse

import fsspec.utils

from pipeline import storage
from pipeline.errors import ConfigError, Interrupted, PipelineError, StepFailed, checkpoint_errors
from pipeline.run.config import Config, PromptsConfig


def check_inputs(cfg: Config, steps: set[str], is_leader: bool = True, dry_run: bool = False,
                 devices: bool = True, tokenizer: bool = True) -> None:
    """Raise ConfigError for the first input of `steps` that cannot work.

    Leader-only steps' inputs (prompts for tokenize, the W&B key for upload) are checked on the
    leader only: the other hosts never read them. A dry run does not probe `run.root` (it writes).
    devices=False leaves out the engine settings against this host's devices (`status` must not
    take a TPU a running job holds); tokenizer=False the tokenizer's load (`status` would import
    transformers and read a remote tokenizer each time).
    """
    if not steps:
        return
    if "tokenize" in steps and is_leader:
        check_prompts(cfg)
    if steps & {"tokenize", "generate"}:
        check_model(cfg, positions="generate" in steps)
    if "tokenize" in steps and is_leader and tokenizer:
        check_tokenizer(cfg)
    if "generate" in steps and devices:
        check_engine(cfg)
    if "upload" in steps and is_leader:
        check_wandb(cfg)
    if not dry_run:
        check_root(cfg)


def input_problem(cfg: Config, steps: set[str]) -> str | None:
    """What `run all` would stop on before any step (a missing prompt file, a model folder that is
    not there, no W&B key: `check_inputs`, without probing run.root, the devices or the tokenizer), or None."""
    try:
        check_inputs(cfg, steps, is_leader=True, dry_run=True, devices=False, tokenizer=False)
    except Interrupted:
        raise
    except PipelineError as err:
        return str(err)
    return None


def check_prompts(cfg: Config) -> None:
    """The prompt files exist and are of a type tokenize reads; with prompts.chat_template the
    tokenizer has a template."""
    for url in prompt_files(cfg.prompts.path):
        prompt_file_format(url, cfg.prompts)
    if cfg.prompts.chat_template:
        from engine.checkpoint import has_chat_template

        with checkpoint_errors(cfg.model.path):
            found = has_chat_template(cfg.model.path)
        if not found:
            raise ConfigError(f"prompts.chat_template is true but the tokenizer at model.path {cfg.model.path} has "
                              f"no chat template (set prompts.chat_template=false, or add chat_template.jinja)")


def prompt_files(pattern: str) -> list[str]:
    """The files `prompts.path` names (sorted), or a ConfigError saying why there are none.

    tokenize lists its input with this too (steps/prompt_files.py), so both say the same."""
    try:
        urls = storage.expand(pattern)
    except Interrupted:  # a stop signal while the storage was retried: exit 75, not a config error
        raise
    except Exception as err:  # noqa: BLE001 - any filesystem's error: add which setting it was
        raise ConfigError(f"prompts.path {pattern} could not be listed: {type(err).__name__}: {err}") from err
    if not urls:
        from engine.checkpoint import relative_hint

        if any(ch in pattern for ch in "*?["):
            hint = "check the folder and the glob" if storage.is_local(pattern) else "check the bucket and the glob"
        elif storage.is_dir(pattern):
            hint = f"a folder without files of its own: {pattern.rstrip('/')}/** reads its subfolders"
        else:
            hint = "no such file, or an empty folder"
        raise ConfigError(f"prompts.path {pattern} matched no files ({hint}{relative_hint(pattern)})")
    return urls


TEXT_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".txt": "txt"}
ARCHIVES = {"zip"}
"""fsspec reads a zip as a compressed file, but a zip holds files: it read the first one alone."""


def kind_of(url: str) -> str | None:
    """'jsonl', 'txt' or 'parquet' from a prompt file's name (a text file's compression suffix
    aside), or None for a type tokenize does not read. tokenize reads each file as its name says,
    and a .txt file's kind enters the step's hash (pipeline/run/identity.py)."""
    name = url.rsplit("/", 1)[-1].lower()
    compression = fsspec.utils.infer_compression(name)
    if compression in ARCHIVES:
        return None
    if compression:
        name = name.rsplit(".", 1)[0]
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
    if suffix == ".parquet" and not compression:
        return "parquet"
    return TEXT_SUFFIXES.get(suffix)


def prompt_file_format(url: str, options: PromptsConfig) -> str:
    """`kind_of`, or a ConfigError for a type tokenize does not read or a .txt file with an id field."""
    kind = kind_of(url)
    if kind is None:
        raise ConfigError(f"prompts.path: prompts file {url}: unsupported file type (expected .jsonl, .ndjson, .txt "
                          f"or .parquet; text files may be compressed: "
                          f"{', '.join(sorted(set(fsspec.utils.compressions) - ARCHIVES))}; a .zip holds files: unpack it)")
    if kind == "txt" and options.id_field:
        raise ConfigError(f"prompts.id_field is {options.id_field!r} but {url} is a .txt file (one prompt "
                          f"per line, no fields): set prompts.id_field=null or use JSONL/Parquet")
    return kind


def check_tokenizer(cfg: Config) -> None:
    """The tokenizer at model.path loads (tokenize would load it first thing): a folder with
    tokenizer_config.json but no tokenizer.json passed the file check, then failed tokenize after
    its folder was made. Loaded once a process: tokenize gets the same one."""
    from engine.checkpoint import BrokenCheckpoint, NotACheckpoint, load_tokenizer

    with checkpoint_errors(cfg.model.path):
        try:
            load_tokenizer(cfg.model.path)
        except BrokenCheckpoint as err:  # found before any step: not a checkpoint we run (exit 2)
            raise NotACheckpoint(str(err)) from err


def check_model(cfg: Config, positions: bool) -> None:
    """model.path is a checkpoint we run; a prompt plus its completion fits its positions."""
    from engine.checkpoint import check_checkpoint

    with checkpoint_errors(cfg.model.path):
        found = check_checkpoint(cfg.model.path)
    if not positions:
        return
    url = storage.join(cfg.model.path, "config.json")
    never = [token for token in cfg.sampling.stop_token_ids if token >= found["vocab_size"]]
    if never:
        raise ConfigError(f"sampling.stop_token_ids {list(cfg.sampling.stop_token_ids)}: {never[0]} is not a token of "
                          f"the checkpoint, whose vocab_size is {found['vocab_size']} ({url}): the model never makes it; "
                          f"give ids below {found['vocab_size']}")
    needed = cfg.prompts.max_prompt_tokens + cfg.sampling.max_new_tokens
    # Past a longrope's original positions transformers turns the whole row to its long factors,
    # which the engine does not implement: it runs rows up to there.
    limits = [("max_position_embeddings", found["max_position_embeddings"], ""),
              ("original_max_position_embeddings", found["longrope_rows"], " (its longrope's short factors)")]
    for key, limit, why in limits:
        if limit is not None and needed > limit:
            raise ConfigError(
                f"prompts.max_prompt_tokens + sampling.max_new_tokens = {cfg.prompts.max_prompt_tokens} + "
                f"{cfg.sampling.max_new_tokens} = {needed} exceeds the checkpoint's {key} {limit}{why} "
                f"({url}): lower one of them to fit")
    # Neither kernel caps scores: capped scores attend the engine's own way.
    attention = cfg.engine.decode_attention
    if attention in ("cpu", "pallas") and found["attn_logit_softcapping"] is not None:
        raise ConfigError(
            f"engine.decode_attention {attention} has plain attention scores, but the checkpoint caps them "
            f"(attn_logit_softcapping {found['attn_logit_softcapping']}, {url}): use auto or xla (the engine's own "
            f"attention caps them)")


def check_engine(cfg: Config) -> None:
    """The engine settings fit this host's devices (engine.mode and mesh, lanes, decode_attention,
    batch_size against their memory) for the shortest prompts: what `Engine.load` checks before it
    reads a weight (`Engine.check`; this imports JAX and sees the devices). generate plans again for
    its longest prompt, and says so where only that does not fit."""
    from engine import Engine
    from engine.config import InvalidConfig

    try:
        with checkpoint_errors(cfg.model.path):
            Engine.check(cfg.model.path, dtype=cfg.model.dtype, sampling=cfg.sampling, engine=cfg.engine)
    except InvalidConfig as err:
        raise ConfigError(str(err)) from err
    except RuntimeError as err:  # JAX's "Unable to initialize backend ...": held by another job, or absent
        if "initialize backend" not in str(err):
            raise
        raise StepFailed(f"generate needs this host's devices, and JAX could not open them: "
                         f"{str(err).splitlines()[0]}") from err


def check_root(cfg: Config) -> None:
    """run.root can be written: locally the nearest existing folder is writable and the root is
    made there (where a link to nowhere or a file system that takes no folders, as /proc, stands
    in the way, the first step's folder could not be); elsewhere a probe object is written and
    removed (it also checks credentials before any work)."""
    root = storage.normalize(cfg.run.root)
    if storage.is_local(root):
        path = storage.filesystem(root)[1]
        existing = path
        while not os.path.exists(existing):
            if os.path.islink(existing):
                raise ConfigError(f"run.root {cfg.run.root}: {existing} is a symbolic link to {os.readlink(existing)}, "
                                  f"which does not exist: make its target, or choose another run.root")
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise ConfigError(f"run.root {cfg.run.root}: {existing} is a file, not a folder")
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            raise ConfigError(f"run.root {cfg.run.root} is not writable ({existing}: Read-only file system); "
                              f"choose another run.root or remount it read-write")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"run.root {cfg.run.root} is not writable ({existing}: permission denied); "
                              f"choose another run.root or fix its permissions")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"run.root {cfg.run.root} cannot be made ({err.strerror}: {err.filename}); "
                              f"choose another run.root") from err
        return
    probe = storage.join(root, f".write-check-{secrets.token_hex(6)}")
    try:
        storage.write_bytes(probe, b"")
        storage.remove(probe)
    except Interrupted:
        raise
    except Exception as err:  # noqa: BLE001 - any filesystem's error: it is this setting that is wrong
        raise ConfigError(f"run.root {cfg.run.root} is not writable: {' '.join(str(err).split())}") from err


def check_wandb(cfg: Config) -> None:
    if cfg.wandb.mode != "online" or _has_wandb_key():
        return
    raise ConfigError("wandb.mode is online but no W&B API key is set (WANDB_API_KEY, or `wandb login`): set "
                      "WANDB_API_KEY, or --set wandb.mode=offline to write a run that `wandb sync` pushes later")


def _has_wandb_key() -> bool:
    """WANDB_API_KEY, or a ~/.netrc entry for the W&B host (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
