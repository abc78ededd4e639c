"""Synthetic agent workloads that mirror the paper's benchmarks (docs/datasets.md).

Each workflow draws a latent (hop count, difficulty, question type) that its task text reveals
and that decides its path, so the task text carries information the call history does not.
Context grows as real agents' does: every call sees its agent's system prompt, the task, and
the transcript so far (earlier outputs and tool results). With ``memory=transcript`` (a workload
knob, data/config.py) agents resend the team's whole conversation instead, as LangChain and
AutoGen memories do: one system prompt for the team (its agents' prompts together), the task,
then every turn so far, each opened by a short hand-over message naming its agent; each call's
prompt then extends the previous call's prompt and output. The random draws are the same in both
memories, so a workflow's path, outputs and tools do not depend on it. Token counts are drawn from
clipped log-normals around the medians below; the task text is counted with the project tokenizer.

Workflow i of seed s is drawn from its own generator seeded (s, i), so the first n workflows
do not depend on how many are generated.

Each workload also declares what its definition says about the path, stored in the dataset's
meta.json by `generate`: `agent_graph` (the static pipeline, or the possible transitions of a
dynamic workflow: the Agent Step Graph KVFlow reads, cache/predictions.py AgentStepGraph) and `bayes_ceiling` (the
best top-1 any predictor can reach at each step k when it knows the latent the task text reveals
and the whole history; Monte Carlo over the generator, docs/predictors.md).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from data.config import FinanceBenchConfig, HoverConfig, SweBenchConfig, WorkloadConfig
from data.schema import SegmentTable, Traces, call_record
from data.task_text import TaskSpace, template_id
from data.tokenizer import TokenCounter


def draw_tokens(rng: np.random.Generator, median: float, sigma: float = 0.4,
                lo: int = 1, hi: int = 64_000) -> int:
    return int(np.clip(round(median * np.exp(sigma * rng.standard_normal())), lo, hi))


def draw_seconds(rng: np.random.Generator, median: float, sigma: float = 0.5) -> float:
    return round(float(median * np.exp(sigma * rng.standard_normal())), 3)


@dataclass
class Tool:
    """A tool an agent calls after its LLM call; its result enters the transcript."""

    result_tokens: int
    seconds: float


@dataclass
class WorkflowBuilder:
    """Accumulates one workflow's calls; each call's prompt = system prompt + task + transcript
    (per-agent memory: the agent's own system prompt; transcript memory: the team's, and the
    transcript holds each turn's hand-over)."""

    workload: "Workload"
    workflow_id: str
    task: str
    task_tokens: int
    latent: dict
    segments: SegmentTable
    calls: list[dict] = field(default_factory=list)
    transcript: list[tuple[str, int]] = field(default_factory=list)
    gap: float = 0.0  # seconds before the next call (the last tool's run time)

    def call(self, agent: str, output_tokens: int, tool: Tool | None = None) -> None:
        step = len(self.calls)
        if self.workload.config.output_scale != 1.0:  # after the draw: the random stream is the same at any scale
            output_tokens = max(1, round(output_tokens * self.workload.config.output_scale))
        prompt = self._prompt(agent, step)
        out_id = f"out:{self.workflow_id}:{step}"
        self.segments.add(out_id, output_tokens, "output")
        self.calls.append(call_record(
            workflow_id=self.workflow_id, step=step, agent=agent, workload=self.workload.name,
            task=self.task, latent=json.dumps(self.latent, sort_keys=True),
            prompt_ids=[s for s, _ in prompt], prompt_segment_tokens=[n for _, n in prompt],
            output_tokens=output_tokens, output_id=out_id, tool_time=self.gap,
        ))
        self.transcript.append((out_id, output_tokens))
        self.gap = 0.0
        if tool is not None:
            tool_id = f"tool:{self.workflow_id}:{step}"
            self.segments.add(tool_id, tool.result_tokens, "tool")
            self.transcript.append((tool_id, tool.result_tokens))
            self.gap = tool.seconds

    def _prompt(self, agent: str, step: int) -> list[tuple[str, int]]:
        """The call's prompt as (segment id, tokens): the system prompt, the task, the transcript."""
        config = self.workload.config
        if config.memory == "transcript":  # one prompt introducing the whole team, shared by every call
            system = (f"sys:{self.workload.name}:team", sum(config.system_prompt_tokens.values()))
        else:
            system = (f"sys:{self.workload.name}:{agent}", config.system_prompt_tokens[agent])
        task_id = f"task:{self.workflow_id}"
        self.segments.add(*system, "system")
        self.segments.add(task_id, self.task_tokens, "task", self.task)
        if config.memory == "transcript":  # the hand-over stays in the conversation every later call resends
            turn_id = f"turn:{self.workflow_id}:{step}"
            self.segments.add(turn_id, config.turn_tokens, "turn")
            self.transcript.append((turn_id, config.turn_tokens))
        return [system, (task_id, self.task_tokens)] + self.transcript

    def finish(self) -> list[dict]:
        self.calls[-1]["end_of_workflow"] = True
        return self.calls


class _PathRecorder:
    """Stands in for a WorkflowBuilder when only the agent path is needed (the Bayes ceiling)."""

    def __init__(self, latent: dict):
        self.latent, self.agents = latent, []

    def call(self, agent: str, output_tokens: int, tool: Tool | None = None) -> None:
        self.agents.append(agent)


END = "END"


class Workload:
    """A workload draws workflows; subclasses define agents, prompts and the path. Its knobs are
    one dataclass (``Config``, data/config.py): keyword arguments override its defaults and are
    checked there, so ``Hover(passage_tokens=0)`` fails as the config ``workload.passage_tokens=0`` does."""

    name: str
    Config: type[WorkloadConfig] = WorkloadConfig
    visible_latent: tuple[str, ...] = ()  # latent fields the task text reveals

    def __init__(self, **settings):
        self.config = self.Config(**settings)
        self.text = TaskSpace(self.config.cue_noise, self.config.template_holdout)

    @property
    def label(self) -> str:
        """The workload's name, with its memory when that is not the default (data.generate prints it)."""
        memory = self.config.memory
        return self.name if memory == WorkloadConfig.memory else f"{self.name} ({memory} memory)"

    def agent_graph(self) -> dict:
        """The workflow's definition as KVFlow's Agent Step Graph reads it: {"kind": "pipeline",
        "steps": [agent, ...]} for a static pipeline, or {"kind": "transitions", "start": [...],
        "next": {agent: [successor, ..., "END"]}} for a dynamic workflow."""
        raise NotImplementedError

    def bayes_ceiling(self, horizon: int = 5, n_workflows: int = 5_000, seed: int = 0) -> dict:
        """Top-1 at k = 1..horizon of the Bayes predictor that knows the visible latent and the
        whole history: its argmax of P(agent at t+k | history, latent) estimated on n_workflows
        draws of the generator, scored on n_workflows other draws. `top1_k{k}` is unconditional
        (steps past the end count as END), `top1_alive_k{k}` counts only steps up to the END."""

        def draws(offset: int):
            for i in range(n_workflows):
                rng = np.random.default_rng([seed, 1 << 30, offset + i])  # apart from datasets' (seed, i)
                _, latent = self.task_and_latent(rng)
                path = _PathRecorder(latent)
                self.run(path, rng)
                yield tuple(latent[k] for k in self.visible_latent), path.agents

        def labels(agents: list[str], t: int):
            for k in range(1, horizon + 1):
                j = t + k
                yield k, (agents[j] if j < len(agents) else END), j <= len(agents)

        counts = {"top1": defaultdict(Counter), "top1_alive": defaultdict(Counter)}
        for visible, agents in draws(0):
            for t in range(len(agents)):
                state = (visible, tuple(agents[:t + 1]))
                for k, label, alive in labels(agents, t):
                    counts["top1"][state, k][label] += 1
                    if alive:
                        counts["top1_alive"][state, k][label] += 1
        hits = {m: Counter() for m in counts}
        totals = {m: Counter() for m in counts}
        for visible, agents in draws(n_workflows):
            for t in range(len(agents)):
                state = (visible, tuple(agents[:t + 1]))
                for k, label, alive in labels(agents, t):
                    for metric in counts:
                        if metric == "top1_alive" and not alive:
                            continue
                        seen = counts[metric].get((state, k))
                        guess = min(seen, key=lambda a: (-seen[a], a)) if seen else None
                        hits[metric][k] += guess == label
                        totals[metric][k] += 1
        return {f"{m}_k{k}": round(hits[m][k] / totals[m][k], 4) if totals[m][k] else None
                for m in counts for k in range(1, horizon + 1)}

    def task_and_latent(self, rng: np.random.Generator) -> tuple[str, dict]:
        raise NotImplementedError

    def run(self, wf: WorkflowBuilder, rng: np.random.Generator) -> None:
        raise NotImplementedError

    def generate(self, n_workflows: int, seed: int = 0, counter: TokenCounter | None = None) -> Traces:
        if n_workflows < 1:
            raise ValueError(f"n_workflows must be positive, got {n_workflows}")
        counter = counter or TokenCounter.wordpiece()
        segments = SegmentTable()
        calls = []
        for i in range(n_workflows):
            rng = np.random.default_rng([seed, i])
            task, latent = self.task_and_latent(rng)
            wf = WorkflowBuilder(self, f"{self.name}-{i:06d}", task, counter.count(task), latent, segments)
            self.run(wf, rng)
            calls.extend(wf.finish())
        meta = {"format": "generated", "workload": self.name, "n_workflows": n_workflows, "seed": seed,
                "template_holdout": bool(self.config.template_holdout),
                "tokenizer": f"task text: {counter.name}; other segments: drawn counts",
                "agent_graph": self.agent_graph()}
        if self.config.memory != WorkloadConfig.memory:  # named when not the default: those datasets stay as they were
            meta["memory"] = self.config.memory
        return Traces(calls, segments, meta)


def generate(workload: Workload, n_workflows: int, seed: int = 0) -> Traces:
    """Hydra target of the `data` config group for generated workloads (and data.generate's): the
    traces, with the Bayes ceiling of their predictors in the meta (a few seconds to estimate)."""
    traces = workload.generate(n_workflows, seed)
    traces.meta["bayes_ceiling"] = {"knows": list(workload.visible_latent), **workload.bayes_ceiling(seed=seed)}
    return traces


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


# --------------------------------------------------------------------------- hover

_PEOPLE = ["Ada Lindqvist", "Marco Ferreira", "Yuki Tanabe", "Omar Haddad", "Greta Novak", "Samuel Okafor",
           "Lena Brandt", "Ivan Petrov", "Clara Mendes", "Tomas Ruiz", "Hana Kim", "Pierre Laurent"]
_FILMS = ["The Silent Harbor", "Glass Orchard", "Northern Static", "A Map of Rivers", "The Last Ferry",
          "Copper Sky", "Hollow Crown Road", "Paper Lanterns"]
_PLACES = ["Lisbon", "Kraków", "Osaka", "Tunis", "Bergen", "Valparaíso", "Tbilisi", "Quebec City", "Porto",
           "Ljubljana", "Da Nang", "Cusco"]
_YEARS = [str(y) for y in range(1921, 2021, 7)]
# relations wrapping an entity X (a claim of h hops chains h - 1 of them under a predicate); each
# has paraphrases, which do not change the template
_HOVER_RELATIONS = [
    ["the director of {x}", "the person who directed {x}", "the filmmaker behind {x}"],
    ["the spouse of {x}", "the person married to {x}"],
    ["the film in which {x} starred", "the movie that featured {x}", "the picture starring {x}"],
    ["the city where {x} was born", "the birthplace of {x}", "the town {x} comes from"],
    ["the composer who scored {x}", "the composer of the music for {x}"],
    ["the university attended by {x}", "the school where {x} studied"],
    ["the sister of {x}", "the older sister of {x}"],
    ["the band whose singer is {x}", "the group fronted by {x}"],
    ["the teacher of {x}", "the mentor of {x}", "the person who trained {x}"],
    ["the studio that produced {x}", "the production company of {x}"],
    ["the novel adapted into {x}", "the book on which {x} is based"],
    ["the festival that premiered {x}", "the event where {x} was first shown"],
]
_HOVER_PREDICATES = [
    ["{s} was born in {c}.", "{s} is a native of {c}.", "{s} came into the world in {c}."],
    ["{s} premiered in {c}.", "{s} was first shown in {c}."],
    ["{s} was founded in {y}.", "{s} dates back to {y}."],
    ["{s} is based in {c}.", "{s} has its headquarters in {c}."],
    ["{s} won a prize in {y}.", "{s} received an award in {y}."],
    ["{s} lived in {c} for a decade.", "{s} spent ten years in {c}."],
]
_HOVER_ANCHORS = [_PEOPLE, _FILMS, _PLACES]
_HOVER_FRAMES = [
    "Verify the claim against Wikipedia. Claim: {body}",
    "Is the following claim supported by Wikipedia? {body}",
    "Fact-check this statement using Wikipedia articles: {body}",
    "Claim to check: {body} Answer SUPPORTED or NOT_SUPPORTED.",
    "Using Wikipedia, decide whether this is true. {body}",
    "A reader submitted this claim; check it against Wikipedia. {body}",
]
_HOVER_DISTRACTORS = [
    "The claim was flagged by a reader from {c}.",
    "Note that the director of {f} also wrote a memoir.",
    "{p} is sometimes confused with the spouse of {p2}.",
    "An earlier version of this claim mentioned {f}.",
    "The sister of {p} gave an interview in {c} in {y}.",
    "Do not rely on the film {f}'s fan wiki.",
    "The birthplace of {p} is disputed in some sources.",
]


def hover_claim(rng: np.random.Generator, hops: int) -> tuple[str, str]:
    """(claim, template id) for a claim of `hops` hops: a predicate over a chain of hops - 1 relations."""
    predicate = int(rng.integers(len(_HOVER_PREDICATES)))
    wording = int(rng.integers(len(_HOVER_PREDICATES[predicate])))
    relations = [int(rng.integers(len(_HOVER_RELATIONS))) for _ in range(hops - 1)]
    anchor = int(rng.integers(len(_HOVER_ANCHORS)))
    subject = _pick(rng, _HOVER_ANCHORS[anchor])
    for r in relations:
        subject = _pick(rng, _HOVER_RELATIONS[r]).format(x=subject)
    claim = _HOVER_PREDICATES[predicate][wording].format(s=subject, c=_pick(rng, _PLACES), y=_pick(rng, _YEARS))
    return claim[0].upper() + claim[1:], template_id(hops, f"{predicate}.{wording}", anchor, *relations)


def fill(rng: np.random.Generator, texts: list[str]) -> list[str]:
    """Distractor sentences with their slots filled."""
    people = rng.permutation(len(_PEOPLE))
    slots = dict(p=_PEOPLE[people[0]], p2=_PEOPLE[people[1]], f=_pick(rng, _FILMS), c=_pick(rng, _PLACES),
                 y=_pick(rng, _YEARS), m=_pick(rng, _MODULES), fn=_pick(rng, _FUNCS), co=_pick(rng, _COMPANIES),
                 n=str(int(rng.integers(1000, 40000))))
    return [t.format(**slots) for t in texts]


class Hover(Workload):
    """Multi-hop fact checking (HoVer + LangChain): retrieve -> summarize, then per further hop
    query_generator -> retriever -> summarizer; a verifier closes and sometimes asks for one more hop.

    Latent: the claim's hop count (1-4), visible as its number of nested relations (with
    probability cue_noise the claim is written with another hop count); whether the verifier asks
    for one more hop is a hidden outcome the text does not reveal. Claims are compositional
    (data/task_text.py): a predicate over a chain of relations, each paraphrased, among distractor
    sentences; thousands of templates, split so that val / test templates are unseen in train.
    """

    name = "hover"
    Config = HoverConfig
    visible_latent = ("hops",)

    def __init__(self, **settings):
        super().__init__(**settings)
        self.hop_probs = np.asarray(self.config.hop_probs, dtype=float)
        self.hop_probs /= self.hop_probs.sum()  # sums to 1 up to rounding (checked): exactly, for rng.choice

    def task_and_latent(self, rng):
        hops = int(rng.choice(len(self.hop_probs), p=self.hop_probs)) + 1
        shown = self.text.cue(rng, hops, range(1, len(self.hop_probs) + 1))
        claim, template = hover_claim(rng, shown)
        task = self.text.compose(rng, _HOVER_FRAMES, claim, fill(rng, _HOVER_DISTRACTORS))
        extra = int(rng.random() < self.config.extra_hop_prob * hops / 2)  # harder claims need a recheck more often
        return task, self.text.latent(template, shown, hops=hops, extra_hops=extra)

    def agent_graph(self):
        return {"kind": "transitions", "start": ["retriever"],
                "next": {"retriever": ["summarizer"], "summarizer": ["query_generator", "verifier"],
                         "query_generator": ["retriever"], "verifier": ["query_generator", END]}}

    def _search(self, rng) -> Tool:
        k = int(rng.integers(self.config.passages_per_search[0], self.config.passages_per_search[1] + 1))
        return Tool(draw_tokens(rng, k * self.config.passage_tokens, 0.2, 200, 12_000),
                    draw_seconds(rng, self.config.search_seconds))

    def _hop(self, wf, rng, first: bool) -> None:
        if not first:
            wf.call("query_generator", draw_tokens(rng, 60, 0.4, 10, 300))
        wf.call("retriever", draw_tokens(rng, 90, 0.4, 10, 400), self._search(rng))
        wf.call("summarizer", draw_tokens(rng, 260, 0.4, 40, 1200))

    def run(self, wf, rng):
        for hop in range(wf.latent["hops"]):
            self._hop(wf, rng, first=hop == 0)
        wf.call("verifier", draw_tokens(rng, 180, 0.4, 20, 800))
        for _ in range(wf.latent["extra_hops"]):
            self._hop(wf, rng, first=False)
            wf.call("verifier", draw_tokens(rng, 180, 0.4, 20, 800))


# --------------------------------------------------------------------------- swebench

_MODULES = ["requests/sessions.py", "django/db/models/query.py", "sympy/core/expr.py", "flask/app.py",
            "astropy/io/fits/header.py", "sklearn/utils/validation.py", "pytest/_code/source.py",
            "matplotlib/axes/_base.py"]
_FUNCS = ["merge_settings", "bulk_update", "as_coeff_add", "make_response", "fromstring", "check_array",
          "getstatement", "set_xlim"]
_SYMPTOMS = {
    "easy": ["there is a typo in the docstring of `{fn}`", "`{fn}` raises an error whose message is misleading",
             "the deprecation warning of `{fn}` names the wrong version", "the docs of `{fn}` link to a dead page",
             "the docstring of `{fn}` states the wrong default"],
    "medium": ["`{fn}` returns a wrong result when an argument is None", "`{fn}` ignores a keyword argument",
               "`{fn}` is off by one for empty inputs", "`{fn}` fails on non-ASCII input",
               "`{fn}` returns the wrong dtype for integer input"],
    "hard": ["`{fn}` intermittently deadlocks when called from several threads",
             "`{fn}` leaks memory when subclasses override __eq__",
             "`{fn}` leaves state inconsistent across modules under the new backend",
             "`{fn}` became quadratic after the caching refactor",
             "objects returned by `{fn}` no longer pickle across versions"],
}
_ISSUE_CONTEXTS = ["In {m}, {s}.", "{S} ({m}).", "Since the last release, {s} in {m}.",
                   "A user reports that {s}; the code is in {m}.", "When running the examples of {m}, {s}."]
_HARD_TAILS = [" The existing tests pass.", " It is a regression.", " Several downstream modules are affected.",
               " It needs an API-compatible redesign."]
_ISSUE_FRAMES = ["Resolve this GitHub issue. {body}", "Fix the following bug report. {body}",
                 "Issue: {body} Write a patch and make the test suite pass.",
                 "Please investigate and fix: {body}"]
_ISSUE_DISTRACTORS = ["Possibly related to #{n}.", "The maintainers labelled it 'needs triage'.",
                      "Another user mentions a deadlock in an unrelated module, fixed last year.",
                      "A typo in the README was fixed separately.", "The reporter uses {m} daily.",
                      "This was discussed on the mailing list in {y}.", "`{fn}` is also used by the CLI."]


def issue_text(rng: np.random.Generator, difficulty: str) -> tuple[str, str]:
    """(issue body, template id): a context sentence around one symptom of the difficulty; hard
    issues add a tail."""
    symptom, context = int(rng.integers(len(_SYMPTOMS[difficulty]))), int(rng.integers(len(_ISSUE_CONTEXTS)))
    text = _SYMPTOMS[difficulty][symptom].format(fn=_pick(rng, _FUNCS))
    body = _ISSUE_CONTEXTS[context].format(s=text, S=text[0].upper() + text[1:], m=_pick(rng, _MODULES))
    tail = int(rng.integers(len(_HARD_TAILS))) if difficulty == "hard" else -1
    return body + (_HARD_TAILS[tail] if tail >= 0 else ""), template_id(difficulty, symptom, context, tail)


class SweBench(Workload):
    """Issue fixing (SWE-bench + AutoGen): planner -> coder -> tester; a failing test run sends the
    work back to the coder, and every `replan_after` failures in a row back to the planner; a
    reviewer closes once tests pass or attempts run out.

    Latent: difficulty (easy / medium / hard), visible in the issue text (with probability
    cue_noise the text is one of another difficulty); it sets the chance that a test run fails,
    and the runs' outcomes, hence the number of retry loops, are hidden from the text.
    """

    name = "swebench"
    Config = SweBenchConfig
    visible_latent = ("difficulty",)

    def task_and_latent(self, rng):
        names = list(self.config.difficulty_probs)
        p = np.asarray([self.config.difficulty_probs[d] for d in names], dtype=float)
        difficulty = names[int(rng.choice(len(names), p=p / p.sum()))]
        shown = self.text.cue(rng, difficulty, names)
        issue, template = issue_text(rng, shown)
        task = self.text.compose(rng, _ISSUE_FRAMES, issue, fill(rng, _ISSUE_DISTRACTORS))
        failures = 0
        while failures < self.config.max_attempts - 1 and rng.random() < self.config.fail_prob[difficulty]:
            failures += 1
        return task, self.text.latent(template, shown, difficulty=difficulty, failed_test_runs=failures)

    def agent_graph(self):
        return {"kind": "transitions", "start": ["planner"],
                "next": {"planner": ["coder"], "coder": ["tester"], "tester": ["coder", "planner", "reviewer"],
                         "reviewer": [END]}}

    def run(self, wf, rng):
        hard = wf.latent["difficulty"] == "hard"
        wf.call("planner", draw_tokens(rng, 500, 0.4, 80, 2000),
                Tool(draw_tokens(rng, 5000, 0.5, 500, 30_000), draw_seconds(rng, 2.0)))
        failures, in_a_row = wf.latent["failed_test_runs"], 0
        for attempt in range(failures + 1):
            if in_a_row == self.config.replan_after:
                wf.call("planner", draw_tokens(rng, 500, 0.4, 80, 2000))
                in_a_row = 0
            wf.call("coder", draw_tokens(rng, 900, 0.5, 60, 4000),
                    Tool(draw_tokens(rng, 250, 0.4, 20, 1500), draw_seconds(rng, 0.5)))
            log_median = 6000 if hard else 2500
            wf.call("tester", draw_tokens(rng, 180, 0.4, 20, 800),
                    Tool(draw_tokens(rng, log_median, 0.6, 200, 24_000), draw_seconds(rng, self.config.test_seconds)))
            in_a_row += attempt < failures
        wf.call("reviewer", draw_tokens(rng, 350, 0.4, 40, 1500))


# --------------------------------------------------------------------------- financebench

_COMPANIES = ["3M", "Adobe", "Amcor", "Boeing", "Costco", "Johnson & Johnson", "PepsiCo", "Verizon",
              "Nike", "Oracle"]
_METRICS = ["revenue", "operating income", "capital expenditure", "free cash flow", "net income"]
_RATIOS = ["quick", "current", "debt-to-equity", "gross margin", "inventory turnover"]
_QUESTIONS = {
    "lookup": ["What was {co}'s {me} in FY{y}?", "Report {co}'s FY{y} {me}.", "How much {me} did {co} book in FY{y}?",
               "Find the {me} {co} disclosed for fiscal {y}."],
    "ratio": ["What is {co}'s FY{y} {ra} ratio, from its balance sheet?", "Compute {co}'s {ra} ratio for FY{y}.",
              "From the FY{y} 10-K, what {ra} ratio does {co} show?"],
    "trend": ["How did {co}'s {me} change from FY{y0} to FY{y}, and what drove the change?",
              "Explain the movement in {co}'s {me} between FY{y0} and FY{y}.",
              "What trend does {co}'s {me} show over FY{y0}-FY{y}, and why?"],
}
_FINANCE_FRAMES = ["Answer from the company's SEC filings. {body}", "Using the annual reports only: {body}",
                   "{body} Cite the filing.", "Question for the analyst team: {body}"]
_FINANCE_DISTRACTORS = ["Figures are in millions of USD.", "Ignore restated numbers.",
                        "Peers such as {co} are not part of the question.", "A ratio is not needed.",
                        "The trend of the sector is out of scope.", "Last year's answer used the 10-Q."]


class FinanceBench(Workload):
    """Financial QA (FinanceBench + CrewAI): a fixed pipeline retriever -> analyst -> calculator ->
    writer for every workflow (the static workload). As CrewAI agents do, each agent works its task
    in a ReAct loop of a fixed number of LLM calls (`react_steps`), each after a tool's result:
    the retriever searches the filing three times, the calculator runs code twice.

    Latent: question type (lookup / ratio / trend), visible in the question (with probability
    cue_noise it is worded as another type); it changes the size of the retrieved filing excerpts
    and outputs, never the path.
    """

    name = "financebench"
    Config = FinanceBenchConfig
    visible_latent = ("question_type",)
    _filing_median = {"lookup": 2000, "ratio": 3500, "trend": 6000}

    def task_and_latent(self, rng):
        names = list(self.config.type_probs)
        p = np.asarray([self.config.type_probs[t] for t in names], dtype=float)
        kind = names[int(rng.choice(len(names), p=p / p.sum()))]
        shown = self.text.cue(rng, kind, names)
        form = int(rng.integers(len(_QUESTIONS[shown])))
        year = int(rng.integers(2015, 2023))
        measure = int(rng.integers(len(_RATIOS if shown == "ratio" else _METRICS)))
        question = _QUESTIONS[shown][form].format(co=_pick(rng, _COMPANIES), me=_METRICS[measure % len(_METRICS)],
                                                  ra=_RATIOS[measure % len(_RATIOS)], y=year, y0=year - 2)
        task = self.text.compose(rng, _FINANCE_FRAMES, question, fill(rng, _FINANCE_DISTRACTORS))
        return task, self.text.latent(template_id(shown, form, measure), shown, question_type=kind)

    def agent_graph(self):
        return {"kind": "pipeline",
                "steps": [a for a in ("retriever", "analyst", "calculator", "writer") for _ in range(self.config.react_steps[a])]}

    def run(self, wf, rng):
        kind = wf.latent["question_type"]
        for _ in range(self.config.react_steps["retriever"]):
            wf.call("retriever", draw_tokens(rng, 120, 0.4, 20, 500),
                    Tool(draw_tokens(rng, self._filing_median[kind], 0.4, 500, 30_000),
                         draw_seconds(rng, self.config.retrieval_seconds)))
        for _ in range(self.config.react_steps["analyst"]):
            wf.call("analyst", draw_tokens(rng, 450 if kind == "trend" else 300, 0.4, 50, 2000))
        for _ in range(self.config.react_steps["calculator"]):
            wf.call("calculator", draw_tokens(rng, 150, 0.4, 20, 800),
                    Tool(draw_tokens(rng, 120, 0.5, 10, 800), draw_seconds(rng, 0.3)))
        for _ in range(self.config.react_steps["writer"]):
            wf.call("writer", draw_tokens(rng, 250, 0.4, 40, 1200))


WORKLOADS = {w.name: w for w in (Hover, SweBench, FinanceBench)}
