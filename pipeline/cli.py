"""The `pipeline` command: parse, build the config, call into `pipeline`, map errors to exit codes.

The only module that turns exceptions into exit codes: 0 done, 1 a step failed, 2 usage or
config error, 75 interrupted (rerun the same command to resume). Every failure ends with
one line starting `error:` that says what and where. Command bodies stay a few lines; the
logic lives in pipeline/run (runner, status_report), pipeline/pod/launch.py and
pipeline/ops/tpu.py, where tests import it. It hands the runner the step graph (`steps.PIPELINE`).

    pipeline run all --config demo/config.yaml
    pipeline status --config demo/config.yaml --json
    pipeline show --config demo/config.yaml -n 5
    pipeline launch --hosts 2 -- run all --config demo/config.yaml
    pipeline tpu run --tpu my-tpu --zone us-east5-a --spot -- run all --config configs/my-run.yaml
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import traceback
from typing import Annotated, Callable, Optional

import typer

from pipeline.pod import preemption
from pipeline.errors import ConfigError, PipelineError, begin_output, end_output, exit_now, one_line

app = typer.Typer(
    rich_markup_mode="markdown",
    help="Batch LLM generation on multi-host JAX: tokenize -> generate -> merge -> upload to W&B.\n\n"
    "Every step is idempotent and addressed by a content hash: rerun the same command after a "
    "crash or preemption and finished work is skipped, unfinished work resumes.\n\n"
    "Example: pipeline run all --config demo/config.yaml",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
run_app = typer.Typer(
    rich_markup_mode="markdown",
    help="Run steps. `all` runs tokenize -> generate -> merge -> upload, skipping complete steps; "
    "a single step needs its upstream steps complete.\n\n"
    "Example: pipeline run all --config demo/config.yaml --set sampling.temperature=0.7",
    no_args_is_help=True,
)
app.add_typer(run_app, name="run")

ConfigOpt = Annotated[str, typer.Option("--config", "-c", help="YAML config file (local path or any fsspec URL).")]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", help="Override a config value: dotted key=YAML value, e.g. --set sampling.n=4 (repeatable).")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Run the step(s) again even if complete.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan with reasons; change nothing.")]
VerboseOpt = Annotated[bool, typer.Option(
    "--verbose", "-v", help="Also print the resolved config and each step's output URL.")]
NoWaitOpt = Annotated[bool, typer.Option(
    "--no-wait", help="If another runner is executing a step on this run root, exit 75 at once instead of waiting.")]


def _guard(body: Callable[[], None], again: str | None = None) -> None:
    """Run a command body; turn exceptions into one `error:` line and the contract's exit code.
    again: the command's `--config ... --set ...` (`_config_args`), which the commands an error
    names get in place of the steps' `--config FILE`."""
    from pipeline.pod import hosts

    preemption.install()
    begin_output()
    try:
        body()
        hosts.leave(0)
    except PipelineError as err:
        _fail(str(err), err.exit_code, again)
    except KeyboardInterrupt:
        _fail("interrupted; rerun the same command to resume", preemption.EXIT_INTERRUPTED)
    except Exception as err:  # noqa: BLE001 - the one place that maps anything to exit 1
        from pipeline.storage.retrying import explain

        explained = explain(err, "write", getattr(err, "filename", None) or "a file")
        if explained is not err:  # disk full, read-only, permission denied: one line, no traceback
            _fail(str(explained), 1, again)
        traceback.print_exc(file=sys.stderr)
        if preemption.stop_requested():
            _fail(f"interrupted while failing ({type(err).__name__}: {err}); rerun to resume",
                  preemption.EXIT_INTERRUPTED)
        _fail(f"{type(err).__name__}: {err}", 1, again)


def _fail(message: str, code: int, again: str | None = None) -> None:
    from pipeline.pod import hosts

    # One line, whatever a library's error held (Arrow's hold newlines), that scripts can take
    # with `tail -1`; the commands it names run this config, --set and all.
    message = one_line(message)
    if again is not None:
        message = message.replace("--config FILE", again)
    typer.echo(f"error: {message}", err=True)
    end_output()  # threads still getting programs announced them after this line
    # The error line stays the last line: gcsfs's event loop can still hold pending reads after a
    # storage failure, and asyncio logs each one ("Task was destroyed but it is pending!") at exit.
    logging.getLogger("asyncio").disabled = True
    hosts.abort(message, code)
    hosts.leave(code)  # on a pod: exits here
    raise typer.Exit(code)


def _config_args(config: str, overrides: list[str] | None) -> str:
    """`--config FILE --set K=V ...` as typed (shell-quoted): the same config again, for the commands
    an error names (without the --set, such a command would make another config's result)."""
    return shlex.join(["--config", config, *(arg for override in overrides or [] for arg in ("--set", override))])


def _run(targets: tuple[str, ...], config: str, overrides: list[str] | None, force: bool, dry_run: bool,
         no_wait: bool, verbose: bool) -> None:
    again = _config_args(config, overrides)

    def body() -> None:
        from pipeline.run.config import load_config
        from pipeline.run.runner import run_steps
        from steps import PIPELINE

        cfg = load_config(config, overrides or [])
        run_steps(cfg, PIPELINE, targets, force=force, dry_run=dry_run, wait=not no_wait, verbose=verbose, again=again)

    _guard(body, again)


@run_app.command("all")
def run_all(config: ConfigOpt, set_: SetOpt = None, force: ForceOpt = False, dry_run: DryRunOpt = False,
        no_wait: NoWaitOpt = False, verbose: VerboseOpt = False) -> None:
    """Run tokenize -> generate -> merge -> upload, skipping every complete step.

    Example: pipeline run all --config demo/config.yaml
    """
    _run(("tokenize", "generate", "merge", "upload"), config, set_, force, dry_run, no_wait, verbose)


@run_app.command("tokenize")
def run_tokenize(config: ConfigOpt, set_: SetOpt = None, force: ForceOpt = False, dry_run: DryRunOpt = False,
        no_wait: NoWaitOpt = False, verbose: VerboseOpt = False) -> None:
    """Read prompts (JSONL/Parquet/.txt, local or gs://), tokenize, write balanced shards (leader).

    Example: pipeline run tokenize --config demo/config.yaml --set prompts.on_invalid=skip
    """
    _run(("tokenize",), config, set_, force, dry_run, no_wait, verbose)


@run_app.command("generate")
def run_generate(config: ConfigOpt, set_: SetOpt = None, force: ForceOpt = False, dry_run: DryRunOpt = False,
        no_wait: NoWaitOpt = False, verbose: VerboseOpt = False) -> None:
    """Generate completions for every shard (all hosts; resumes what a preempted run left).

    Example: pipeline launch --hosts 2 -- run generate --config demo/config.yaml
    """
    _run(("generate",), config, set_, force, dry_run, no_wait, verbose)


@run_app.command("merge")
def run_merge(config: ConfigOpt, set_: SetOpt = None, force: ForceOpt = False, dry_run: DryRunOpt = False,
        no_wait: NoWaitOpt = False, verbose: VerboseOpt = False) -> None:
    """Check every (prompt, sample) exists once, order them, write the result (leader).

    Example: pipeline run merge --config demo/config.yaml
    """
    _run(("merge",), config, set_, force, dry_run, no_wait, verbose)


@run_app.command("upload")
def run_upload(config: ConfigOpt, set_: SetOpt = None, force: ForceOpt = False, dry_run: DryRunOpt = False,
        no_wait: NoWaitOpt = False, verbose: VerboseOpt = False) -> None:
    """Log the merged result to W&B as a `generations` artifact, resuming the same W&B run.

    Example: pipeline run upload --config demo/config.yaml --force
    """
    _run(("upload",), config, set_, force, dry_run, no_wait, verbose)


@app.command("status")
def status_command(
    config: ConfigOpt,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: {\"steps\": [...]}.")] = False,
) -> None:
    """Show each step's hash, output URL, state (complete/partial/missing), rows, why it would (not) run, and
    where the merged result is.

    Example: pipeline status --config demo/config.yaml --json
    """

    def body() -> None:
        from pipeline.run.config import load_config
        from pipeline.run.status_report import report, report_json, report_text, result_of
        from steps import PIPELINE

        rows = report(load_config(config, set_ or []), PIPELINE)
        result = result_of(rows)
        typer.echo(json.dumps(report_json(rows, result), indent=2) if as_json else report_text(rows, result))

    _guard(body, _config_args(config, set_))


@app.command("show")
def show_command(
    config: ConfigOpt,
    set_: SetOpt = None,
    rows: Annotated[int, typer.Option("--rows", "-n", min=1, help="How many rows to show.")] = 5,
) -> None:
    """Show the first rows of this config's result as a table: prompt, completion, finish reason.

    With sampling.logprobs, also each completion's mean log-probability per token; with
    sampling.prompt_logprobs, the prompt's.

    Example: pipeline show --config demo/config.yaml -n 3
    """

    again = _config_args(config, set_)

    def body() -> None:
        from pipeline.run.config import load_config
        from pipeline.run.result import show_text
        from steps import PIPELINE

        typer.echo(show_text(load_config(config, set_ or []), PIPELINE, again, rows))

    _guard(body, again)


@app.command("preflight")
def preflight_command(
    config: ConfigOpt,
    set_: SetOpt = None,
    expect_hosts: Annotated[Optional[int], typer.Option(
        "--expect-hosts", min=1, help="Fail (exit 2) unless the pod has exactly this many hosts.")] = None,
) -> None:
    """Check the pod before any real work: every host joined, same code and same plan (step hashes).

    Run it with the same launcher as the real job; it fails fast naming the odd host.
    Example: pipeline launch --hosts 2 -- preflight --config demo/config.yaml --expect-hosts 2
    """

    def body() -> None:
        from pipeline.run.config import load_config
        from pipeline.run.runner import preflight
        from steps import PIPELINE

        typer.echo(preflight(load_config(config, set_ or []), PIPELINE, expect_hosts=expect_hosts))

    _guard(body, _config_args(config, set_))


@app.command(
    "launch",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def launch_command(
    ctx: typer.Context,
    hosts: Annotated[int, typer.Option("--hosts", "-n", min=1, help="Number of local processes (simulated hosts).")],
    port: Annotated[int, typer.Option("--port", help="Coordinator port on 127.0.0.1 (0 = pick a free one).")] = 0,
) -> None:
    """Start N local processes of `pipeline ARGS...` joined by jax.distributed: a pod on one machine.

    Each process gets PIPELINE_COORDINATOR_ADDRESS, PIPELINE_NUM_PROCESSES and
    PIPELINE_PROCESS_ID; each host's lines are prefixed with its index (its stdout on ours, its stderr on ours). Exits with the
    worst host's exit code (75 if the only failures were interruptions).

    Example: pipeline launch --hosts 2 -- run all --config demo/config.yaml
    """

    codes: list[int] = []

    def body() -> None:
        from pipeline.pod.launch import launch

        args = ctx.args[1:] if ctx.args[:1] == ["--"] else list(ctx.args)
        if not args:
            raise ConfigError("launch: nothing to run; e.g. pipeline launch --hosts 2 -- run all --config FILE")
        codes.append(launch(args, hosts=hosts, port=port))

    _guard(body)
    if codes and codes[0]:
        raise typer.Exit(codes[0])


tpu_app = typer.Typer(
    rich_markup_mode="markdown",
    help="Run on a Cloud TPU VM or queued resource through gcloud, and babysit it through preemptions.\n\n"
    "Example: pipeline tpu run --tpu my-tpu --zone us-east5-a --accelerator-type v5p-16 "
    "--runtime-version v2-alpha-tpuv5 --spot -- run all --config configs/my-run.yaml",
    no_args_is_help=True,
)
app.add_typer(tpu_app, name="tpu")


@tpu_app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def tpu_run_command(
    ctx: typer.Context,
    tpu: Annotated[str, typer.Option("--tpu", help="TPU VM name (and queued resource name with --queued).")],
    zone: Annotated[str, typer.Option("--zone", help="e.g. us-east5-a")],
    project: Annotated[Optional[str], typer.Option("--project", help="GCP project (default: gcloud's).")] = None,
    accelerator_type: Annotated[Optional[str], typer.Option(
        "--accelerator-type", help="e.g. v5p-16; needed to create a missing TPU, else read from describe.")] = None,
    runtime_version: Annotated[Optional[str], typer.Option(
        "--runtime-version", help="TPU software version, e.g. v2-alpha-tpuv5; as --accelerator-type.")] = None,
    spot: Annotated[bool, typer.Option("--spot", help="Spot TPU: recreated when preempted.")] = False,
    queued: Annotated[bool, typer.Option("--queued", help="Create and recreate through a queued resource.")] = False,
    retries: Annotated[int, typer.Option("--retries", min=0, help="Reruns after the first attempt.")] = 5,
    workdir: Annotated[str, typer.Option("--workdir", help="The checkout on each worker (relative to home).")]
    = "jax-batch-pipeline",
    setup: Annotated[Optional[str], typer.Option(
        "--setup", help="Shell run in --workdir before each attempt, e.g. 'git pull && bash scripts/setup.sh'.")] = None,
    pipeline_bin: Annotated[str, typer.Option("--pipeline", help="The pipeline command on the workers.")]
    = ".venv/bin/pipeline",
    log: Annotated[Optional[str], typer.Option(
        "--log", help="Attempt log, one JSON line per attempt (default: tpu-NAME-attempts.jsonl).")] = None,
    backoff_s: Annotated[float, typer.Option("--backoff-s", min=0, help="Wait before the first rerun; doubles.")]
    = 60.0,
    poll_s: Annotated[float, typer.Option("--poll-s", min=0, help="Seconds between describes while waiting.")]
    = 30.0,
    ready_timeout_s: Annotated[float, typer.Option("--ready-timeout-s", min=0, help="Longest wait for READY.")]
    = 86400.0,
) -> None:
    """Run `pipeline ARGS...` on every worker of a TPU; when preempted, recreate it and rerun (it resumes).

    Each attempt: wait until the TPU is READY (create it; delete and recreate it if a spot/queued one is gone).

    Then `pipeline preflight --expect-hosts N` on all N workers: fails fast naming the odd or unreachable worker.

    Then the run on all workers. Exit 75, a lost worker or a preempted TPU: rerun, up to --retries.

    Exit 1 or 2 on a READY TPU: stop at once with that code. The W&B run id stays the same across attempts.

    One JSON line per attempt goes to --log. Example (creates the TPU if missing):

    pipeline tpu run --tpu my-tpu --zone us-east5-a --accelerator-type v5p-16 --runtime-version v2-alpha-tpuv5 --spot -- run all --config configs/my-run.yaml
    """  # noqa: E501 - the example must stay one line to copy

    def body() -> None:
        from pipeline.ops import tpu as tpu_mod

        args = ctx.args[1:] if ctx.args[:1] == ["--"] else list(ctx.args)
        target = tpu_mod.Tpu(tpu, zone, project, accelerator_type, runtime_version, spot, queued)
        remote = tpu_mod.Remote(args, workdir, setup, pipeline_bin)
        policy = tpu_mod.Policy(retries, backoff_s, max(backoff_s, 900.0), poll_s, ready_timeout_s)
        typer.echo(tpu_mod.babysit(target, remote, policy, log or f"tpu-{tpu}-attempts.jsonl"))

    _guard(body)


def main() -> None:
    _keep_torch_out()
    # Storage libraries' own logs, quiet: fsspec's prefetcher (Parquet read from gs://) leaves tasks
    # pending in gcsfs's event loop, which asyncio logs as they are collected ("Task was destroyed but
    # it is pending!", dozens in a run's output); gcsfs and fsspec's prefetcher log each request they
    # give up on with a traceback. The pipeline's own line says what failed and where (`_fail`).
    for name in ("asyncio", "gcsfs", "fsspec"):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)  # and their children (fsspec.prefetcher)
    from pipeline.pod import supervise

    if os.environ.get(supervise.ENV_SUPERVISED) == "1":
        preemption.install()  # now: a copy of a stop signal would end the process before `_guard` listens
    elif supervise.wanted(sys.argv[1:], os.environ):  # a pod host: JAX may end it natively (supervise.py)
        sys.exit(supervise.run(sys.argv[1:]))
    try:
        code = _run_app()
    finally:
        preemption.ignore_from_now()  # the exit code stands (not in tests, which call `app`)
    engine = sys.modules.get("engine.engine")  # imported only by a command that generates
    if code != 0 and engine is not None and engine.compiling_ahead():
        # The interpreter's exit would wait for XLA to finish compiling programs no call will run
        # (engine.compile_during_load: on an accelerator with an 8B model, minutes). Here, not in
        # `_fail`: `app` called in a process that goes on (tests, a notebook) must not end it.
        exit_now(code)
    sys.exit(code)


def _keep_torch_out() -> None:
    """Mark PyTorch unimportable in a `pipeline` process, which never uses it. transformers imports
    it wherever it is installed (configuration_utils -> modeling_rope_utils -> torch), for the
    tokenizer alone: 2.3 s and 240 MB of every process that tokenizes or generates, where the
    tokenizer itself loads in 0.8 s. A None in `sys.modules` is Python's own way to refuse an
    import; transformers then finds no torch and loads the same tokenizer. Only here, in the
    process's entry point: tests and notebooks that call `app` keep their torch."""
    sys.modules.setdefault("torch", None)


_USAGE_ERROR = typer.BadParameter.__mro__[1]
"""click's UsageError (typer's own copy of click in newer versions): a missing or unknown option, a
value the option's type refuses."""


def _run_app() -> int:
    """The app's exit code. A usage error is the contract's one `error:` line and exit 2 (click
    printed a boxed panel, which a script looking for `error:` missed); the bare command, or a
    group without a command, still prints its help."""
    try:
        code = app(prog_name="pipeline", standalone_mode=False)
    except _USAGE_ERROR as err:
        if type(err).__name__ == "NoArgsIsHelpError":
            err.show()
            return err.exit_code
        command = err.ctx.command_path if err.ctx is not None else _command_path(sys.argv[1:])
        typer.echo(f"error: {' '.join(err.format_message().split())} (see `{command} --help`)", err=True)
        return 2
    except typer.Abort:  # end of input or Ctrl-C at a prompt (the commands ask none)
        typer.echo("Aborted!", err=True)
        return 1
    return code if isinstance(code, int) else 0


def _command_path(argv: list[str]) -> str:
    """`pipeline run all` for `run all -c`: the command a usage error click reports without its
    context (an option missing its value) belongs to, from the words before the first option."""
    words, command = ["pipeline"], typer.main.get_command(app)
    for word in argv:
        sub = getattr(command, "commands", {}).get(word)
        if sub is None:
            break
        words.append(word)
        command = sub
    return " ".join(words)


if __name__ == "__main__":
    main()
