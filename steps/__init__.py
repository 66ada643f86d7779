"""The pipeline's steps and their graph: one module per step, and `PIPELINE`, the order they run in.

Each step is a plain function of (config, output) declared as a `Step` with the steps it reads;
the runner (pipeline/run/runner.py) walks this graph, and the CLI hands it over.

    tokenize -> generate -> merge -> upload
"""

from pipeline.run.step import Step
from steps import generate, merge, tokenize, upload  # the modules: `steps.tokenize` stays a module

TOKENIZE = Step("tokenize", tokenize.tokenize, about="read prompts, tokenize, write balanced Parquet shards")
# version 2: sampling without top_k draws one uniform number per token (engine/sampler.py), so
# a seed gives other tokens than version 1 did; a run of version 1 is redone, never mixed in.
# version 3: a checkpoint's EOS ids and rotation are read as transformers reads them (a
# rope_scaling over rope_parameters, generation_config.json's eos_token_id, Mixtral's theta).
GENERATE = Step("generate", generate.generate, inputs=(TOKENIZE,), on="every host", finish=generate.finish,
                version="3", progress=generate.progress, about="every host generates completions for its shards")
MERGE = Step("merge", merge.merge, inputs=(GENERATE,), redo=merge.redo,
             about="verify every (prompt, sample) once, order, write the result")
UPLOAD = Step("upload", upload.upload, inputs=(MERGE,), redo=upload.redo,
              about="log a W&B table artifact, resuming the same W&B run")

PIPELINE: tuple[Step, ...] = (TOKENIZE, GENERATE, MERGE, UPLOAD)
STEP_NAMES: tuple[str, ...] = tuple(s.name for s in PIPELINE)
