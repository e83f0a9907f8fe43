"""Offline prompt suites for the bench: code, math, instructions, chat (each >= 64 prompts).

Every suite is a pure function of (seed, installed Python): nothing is downloaded. They are
disjoint from the draft's training prompts (ssd_jax.distill.prompts):
- code: functions of the standard-library modules that are *not* in the distillation half
  (`is_training_module(name)` is False); distillation reads only the other half;
- math: generated word problems (the training mix has no math at all);
- instructions, chat: hand-written here; none is an instance of the training templates
  (tests/test_bench.py checks that against the templates themselves).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SUITES = ("code", "math", "instructions", "chat")
MAX_DOC_CHARS, MAX_SIG_CHARS = 200, 120  # code prompts stay under ~128 SmolLM2 chat tokens


@dataclass(frozen=True)
class Prompt:
    text: str
    suite: str
    answer: str | None = None  # math: the exact answer; others: None
    source: str = ""  # code: module.function


def _is_training_module(name: str) -> bool:
    try:
        from ssd_jax.distill.prompts import is_training_module
    except ImportError:  # same rule as the distillation split: SHA-256 of the name, parity
        return hashlib.sha256(name.encode()).digest()[0] % 2 == 0
    return is_training_module(name)


# ------------------------------------------------------------------ code
def _summary(doc: str) -> str | None:
    """The docstring's first paragraph on one line, cut at a sentence end to fit the cap."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    if len(para) <= MAX_DOC_CHARS:
        return para
    cut = para[:MAX_DOC_CHARS].rfind(". ")
    return para[:cut + 1] if cut > 0 else None


@functools.lru_cache(maxsize=1)
def code_pool() -> tuple[Prompt, ...]:
    """'Write this function' for every public, documented top-level function of the held-out
    stdlib modules, in (module, line) order. Parsed with `ast`, never imported."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        name = path.stem
        if name.startswith(("_", "test")) or _is_training_module(name):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in tree.body:
            doc = isinstance(node, ast.FunctionDef) and ast.get_docstring(node)
            if not doc or node.name.startswith("_"):
                continue
            sig = f"def {node.name}({ast.unparse(node.args)}):"
            first = _summary(doc)
            if first is None or len(sig) > MAX_SIG_CHARS:
                continue
            text = (f"Write this Python function (from the `{name}` module):\n```python\n{sig}\n"
                    f'    """{first}"""\n```')
            out.append(Prompt(text, "code", source=f"{name}.{node.name}"))
    return tuple(out)


# ------------------------------------------------------------------ math
NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas",
         "Kemi", "Liam", "Mei", "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara"]


def _math_problem(rng: random.Random) -> tuple[str, int]:
    n = rng.choice(NAMES)
    kind = rng.randrange(10)
    a, b, c = rng.randint(2, 12), rng.randint(2, 9), rng.randint(2, 7)
    if kind == 0:
        return (f"{n} bakes {a + b} muffins every morning and sells {b} of them. How many muffins "
                f"are left over after {c} days?", a * c)
    if kind == 1:
        price = rng.randint(2, 15)
        return (f"{n} buys {a} notebooks at ${price} each and pays with a ${a * price + b * 5} "
                "bill. How much change does " + n + " get?", b * 5)
    if kind == 2:
        return (f"A train travels at {a * 10} km per hour for {b} hours and then at {c * 10} km "
                f"per hour for {c} hours. How far does it travel in total?",
                a * 10 * b + c * 10 * c)
    if kind == 3:
        return (f"{n} reads {a} pages on weekdays and {b} pages on each weekend day. How many "
                "pages does " + n + f" read in {c} full weeks?", (5 * a + 2 * b) * c)
    if kind == 4:
        total = a * b * c
        return (f"A farmer has {total} apples and packs them into boxes of {a}. Each truck holds "
                f"{b} boxes. How many trucks are needed?", c)
    if kind == 5:
        w, h = a + 3, b + 2
        return (f"A rectangular garden is {w} meters long and {h} meters wide. A path 1 meter "
                "wide runs around the outside of it. What is the area of the path in square "
                "meters?", (w + 2) * (h + 2) - w * h)
    if kind == 6:
        older = a + b
        return (f"{n} is {older} years old and {n}'s cousin is {b} years younger. In {c} years, "
                "what will the sum of their ages be?", older + (older - b) + 2 * c)
    if kind == 7:
        pct = rng.choice([10, 20, 25, 50])
        price = 20 * a
        return (f"A jacket costs ${price}. It is on sale for {pct}% off, and {n} has a coupon for "
                f"another ${b}. What does {n} pay?", price - price * pct // 100 - b)
    if kind == 8:
        return (f"{n} saves ${a} in the first week and ${b} more each week than the week before. "
                f"How much has {n} saved after {c} weeks?", sum(a + b * i for i in range(c)))
    return (f"There are {a} red, {b} blue and {c} green marbles in a bag. {n} adds twice as "
            "many yellow marbles as there are blue ones. How many marbles are in the bag now?",
            a + b + c + 2 * b)


def math_pool(seed: int, n: int = 128) -> list[Prompt]:
    rng = random.Random(f"math:{seed}")
    seen, out = set(), []
    while len(out) < n:
        text, answer = _math_problem(rng)
        if text not in seen:
            seen.add(text)
            out.append(Prompt(text + " Show your reasoning, then give the answer.", "math",
                              answer=str(answer)))
    return out


# ------------------------------------------------------------------ instructions and chat
INSTRUCTIONS = """\
Write a packing checklist for a three-day hiking trip in the mountains.
Summarize the plot of a mystery novel you invent, in five sentences.
Draft a short apology email to a customer whose order arrived late.
Explain how a bicycle gear system works, using an everyday analogy.
List the steps to change a flat tire on a car.
Write a product description for a reusable water bottle made of glass.
Describe how to make a paper airplane that flies far.
Translate the phrase "good morning, how are you?" into Spanish, French and German.
Write a four-line rhyming poem about a rainy Monday.
Give a one-paragraph overview of how vaccines train the immune system.
Create a weekly meal plan for a vegetarian on a budget.
How would you explain the difference between weather and climate to a ten-year-old?
Write a job posting for a part-time librarian.
Outline a 20-minute beginner workout that needs no equipment.
Suggest five names for a podcast about urban gardening.
Rewrite this sentence in a formal tone: "hey, can u send me the report asap?"
Write a short speech to thank volunteers at a charity event.
Explain what an API is, with an example a non-programmer would understand.
Describe the life cycle of a butterfly in simple terms.
Give me a step-by-step recipe for pancakes.
Write a limerick about a cat who loves to sleep in a shoebox.
Explain why the sky looks red at sunset.
Compose a polite reminder to a neighbour about returning a borrowed ladder.
List six questions to ask when renting an apartment.
Describe three ways to reduce food waste at home.
Write the opening paragraph of a science fiction story set on Europa.
Explain the rules of chess pawn promotion.
Create a study schedule for someone preparing for an exam in two weeks.
Write a thank-you note to a teacher at the end of the school year.
Explain how a compass finds north.
Draft a tweet announcing the opening of a new bookshop.
Summarize the benefits of regular stretching in three bullet points.
Write instructions for planting a tulip bulb.
Explain what inflation means and how it affects savings.
Give five tips for writing clear emails at work.
Describe a sunrise over the ocean without using the words "sun" or "light".
Write a short dialogue between a robot and a gardener.
Explain how to calculate the tip on a restaurant bill.
List the pros and cons of working from home.
Write a riddle whose answer is "a shadow".
Explain how noise-cancelling headphones work.
Suggest a plan for a rainy-day activity with two young children.
Write a brief biography of a fictional inventor named Ada Wren.
Explain the purpose of a budget and how to start one.
Describe how bread rises, from yeast to oven.
Write a short motivational message for someone starting a new job.
Give three examples of renewable resources and one sentence about each.
Explain what a leap year is and why we have them.
Draft an agenda for a one-hour team planning meeting.
Write a haiku sequence (three haiku) about autumn in a city.
Explain the difference between a virus and a bacterium.
List the steps to back up photos from a phone to a computer.
Write a review of an imaginary Italian restaurant.
Explain how to tie a bowline knot.
Create a simple bedtime routine for a toddler.
Describe the main parts of a flower and what each does.
Write a letter to your future self to be opened in ten years.
Explain how a credit score works in plain language.
Give me a checklist for moving to a new apartment.
Write a short fable that teaches patience.
Explain how tides are connected to the moon.
Propose three fun team-building games for a small office.
Write a set of house rules for a shared kitchen.
Explain the basics of composting for a beginner.
Describe how to prepare for a job interview the night before.
Write an encouraging note for a friend running their first marathon.
Explain what a spreadsheet formula is with one example.
List five safety tips for cycling in traffic.
Write a short advertisement for a neighbourhood yard sale.
Explain the water filtration process used in cities.
Give advice on how to keep houseplants alive while on vacation.
Write a paragraph describing a busy train station at rush hour.
""".strip().splitlines()

CHAT = """\
Hi! I just adopted a kitten. Any advice for the first week?
I can't decide between learning guitar or piano. What do you think?
My sourdough starter smells weird. Is that normal?
What's a good way to spend a lazy Sunday afternoon?
Can you help me come up with a birthday message for my dad?
I'm nervous about giving a presentation tomorrow. Any tips?
Do you have a favourite book recommendation for a long flight?
I keep forgetting to drink water during the day. How do I fix that?
What's the best way to learn to cook if I've never cooked before?
My friend and I argued about whether tomatoes are fruit. Who's right?
I'm bored. Tell me something surprising about space.
How do I politely say no to extra work from my boss?
Could you suggest a name for my new goldfish?
I want to start journaling. How should I begin?
What should I do if I can't fall asleep at night?
I'm planning a picnic. What food travels well?
Is it worth learning to touch type?
Tell me a joke about computers.
I just moved to a new city and don't know anyone. How can I meet people?
My plants keep dying. What am I doing wrong?
What's a fun hobby I can do at home in the evenings?
How can I make my morning routine less rushed?
Can you explain why cats purr?
I want to surprise my partner with dinner. Any easy ideas?
Why do onions make me cry when I cut them?
What's a good board game for four people?
I'm thinking about getting a bike for commuting. Is it a good idea?
How do you keep a conversation going with someone you just met?
My laptop is really slow lately. What can I try?
Can you recommend a simple stretch for a stiff neck?
I'd like to read more this year. How do I build the habit?
What's the difference between a latte and a cappuccino?
How do I get better at remembering people's names?
I have an old t-shirt collection. What could I make with them?
Can you give me a quick pep talk? I'm feeling unmotivated.
Why is the ocean salty but rivers aren't?
What should I name my fantasy football team?
I want to start running but I hate it. Any advice?
How do I clean a cast iron pan?
Tell me a short bedtime story about a sleepy owl.
How do I deal with a noisy upstairs neighbour?
What's a good gift for someone who has everything?
I burned my rice again. How do I cook it properly?
Is it better to study in the morning or at night?
Can you help me plan a day trip to the beach?
What are some good questions to ask on a first date?
My dog barks at every delivery person. What can I do?
I feel like I'm always on my phone. How can I cut back?
What's an easy dessert I can make without an oven?
Can you describe what it would feel like to walk on the moon?
I'm learning Spanish. Can you chat with me about the weather, in simple Spanish?
Why do we get hiccups?
My kids are bored on long car rides. Any game ideas?
Should I fix my old phone or buy a new one?
What's something kind I could do for a coworker this week?
How do I start a conversation with my neighbours?
I'm hosting a game night. What snacks should I get?
Why do some people like spicy food so much?
What's the easiest houseplant to keep alive?
I have ten minutes before a meeting. How can I relax?
Do you think it's rude to text during dinner?
How can I make my small bedroom feel bigger?
What's a good way to celebrate finishing a big project?
Can you tell me a fun fact about penguins?
I'm writing a card for a friend who is moving away. What should I say?
How do I keep my bread fresh for longer?
Why do leaves rustle more before a storm?
""".strip().splitlines()


def _shuffled(pool: list[Prompt], seed: int, suite: str) -> list[Prompt]:
    out = list(pool)
    random.Random(f"{suite}:{seed}").shuffle(out)
    return out


def pool(suite: str, seed: int = 0) -> list[Prompt]:
    """All prompts of a suite, in a seed-determined order."""
    if suite == "code":
        return _shuffled(code_pool(), seed, suite)
    if suite == "math":
        return math_pool(seed)
    if suite in ("instructions", "chat"):
        lines = INSTRUCTIONS if suite == "instructions" else CHAT
        return _shuffled([Prompt(t, suite) for t in lines], seed, suite)
    raise ValueError(f"unknown suite {suite!r}: use one of {', '.join(SUITES)} or all")


def load_suite(suite: str, n: int, seed: int = 0) -> list[Prompt]:
    """The first n prompts of the suite's seeded order."""
    prompts = pool(suite, seed)
    if n > len(prompts):
        raise ValueError(f"--num-prompts {n} exceeds the {len(prompts)} prompts of suite "
                         f"{suite!r}: ask for at most {len(prompts)}")
    return prompts[:n]
