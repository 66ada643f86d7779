"""The pipeline's steps and their graph: one module per step, and `PIPELINE`, the order they run in.

Each step is a plain function of (config, output) declared as a `Step` with the steps it reads;
the runner (pipeline/run/runner.py) walks this graph, and the CLI hands it over.

    tokenize -> generate -> merge -> upload
"""

from pipeline.run.step import Step
from steps.generate import finish as finish_generate
from steps.generate import generate
from steps.merge import merge
from steps.tokenize import tokenize
from steps.upload import upload

TOKENIZE = Step("tokenize", tokenize, about="read prompts, tokenize, write balanced Parquet shards")
GENERATE = Step("generate", generate, inputs=(TOKENIZE,), on="every host", finish=finish_generate,
                about="every host generates completions for its shards")
MERGE = Step("merge", merge, inputs=(GENERATE,), about="verify every (prompt, sample) once, order, write the result")
UPLOAD = Step("upload", upload, inputs=(MERGE,), about="log a W&B table artifact, resuming the same W&B run")

PIPELINE: tuple[Step, ...] = (TOKENIZE, GENERATE, MERGE, UPLOAD)
STEP_NAMES: tuple[str, ...] = tuple(s.name for s in PIPELINE)
