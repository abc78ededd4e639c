"""Task texts of the generated workloads: a large compositional space, so that a predictor cannot
solve a workload by recognising its template.

A task text = an instruction frame (paraphrased) + a body built from parts + distractor sentences.
The body's *template* is the tuple of part ids it was built from (not the slot fillers or the
paraphrase); it is what `template_holdout` holds out: a stable hash of the template puts a share of
all templates in a held-out group, whose workflows the dataset store places only in val / test
(data/store.py), so no test template appears in train. The body reveals a *cue* of the latent (hop
count, difficulty, question type); with probability `cue_noise` the body is built for another
value of the latent than the true one, so the text predicts the latent only as well as the noise
allows. Distractors are sentences that reuse the body's vocabulary (relations, symptoms, metrics)
without bearing on the task, so counting words does not recover the latent.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def pick(rng: np.random.Generator, options: Sequence):
    return options[int(rng.integers(len(options)))]


def template_id(*parts) -> str:
    return "-".join(str(p) for p in parts)


def noisy_cue(rng: np.random.Generator, value, values: Sequence, cue_noise: float):
    """The latent value the text is built for: the true one, or with probability cue_noise one
    drawn uniformly from the others."""
    if cue_noise > 0 and rng.random() < cue_noise:
        others = [v for v in values if v != value]
        if others:
            return pick(rng, others)
    return value


class TaskSpace:
    """What each generator shares: the holdout and cue-noise settings and the draw of a text."""

    def __init__(self, cue_noise: float, template_holdout: bool, max_distractors: int = 2):
        # cue_noise and template_holdout: data.config.WorkloadConfig, their home and range
        self.cue_noise, self.template_holdout, self.max_distractors = cue_noise, template_holdout, max_distractors

    def cue(self, rng, value, values):
        return noisy_cue(rng, value, values, self.cue_noise)

    def compose(self, rng, frames: Sequence[str], body: str, distractors: Sequence[str]) -> str:
        n = int(rng.integers(self.max_distractors + 1))
        extra = [distractors[i] for i in rng.permutation(len(distractors))[:n]] if distractors else []
        sentences = [body] + extra
        order = [0] + (rng.permutation(len(extra)) + 1).tolist()  # the body first, then shuffled
        return pick(rng, frames).format(body=" ".join(sentences[i] for i in order))

    def latent(self, template: str, cue, **latent) -> dict:
        """The latent as recorded in the calls' `latent` column: the hidden variables that decide the
        path, the task template and the cue the text shows."""
        return {**latent, "template": template, "cue": cue}
