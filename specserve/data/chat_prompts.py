"""Chat prompts made offline, for training drafters on a chat model's own answers and for
measuring them: instructions and questions over a topic list written here, questions the
target writes itself about those topics (`question_requests`), small problems with numbers,
and code tasks made from the functions, classes and docstrings of the running interpreter's
standard library. None come from a
public benchmark set. A prompt is held out (never trained on) by a hash of its text, so the
split is the same on every machine with the same Python version.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import random
import warnings

from specserve.data.corpus import Corpus, read_text

TOPICS = (
    "the water cycle", "photosynthesis", "volcanoes", "black holes", "the moon's phases",
    "plate tectonics", "climate and weather", "the human heart", "vaccines", "sleep",
    "nutrition", "exercise", "honey bees", "coral reefs", "rainforests", "deserts", "glaciers",
    "electricity", "magnets", "the speed of light", "gravity", "atoms", "chemical reactions",
    "the periodic table", "DNA", "evolution", "dinosaurs", "the Roman Empire",
    "ancient Egypt", "the printing press", "the industrial revolution", "the internet",
    "smartphones", "batteries", "solar power", "wind turbines", "recycling", "composting",
    "gardening", "baking bread", "making coffee", "tea", "chocolate", "cheese", "rice",
    "cooking pasta", "knife safety in the kitchen", "budgeting", "saving money",
    "compound interest", "taxes", "starting a small business", "job interviews",
    "writing a resume", "public speaking", "time management", "learning a language",
    "reading habits", "writing a short story", "poetry", "music theory", "learning guitar",
    "painting with watercolors", "photography", "chess", "football", "running a marathon",
    "swimming", "yoga", "meditation", "friendship", "teamwork", "giving feedback",
    "remote work", "email etiquette", "traveling by train", "packing for a trip",
    "camping", "hiking safety", "first aid", "pets", "training a dog", "cats", "birds",
    "the ocean", "sharks", "whales", "elephants", "bridges", "skyscrapers", "airplanes",
    "rockets", "the International Space Station", "Mars", "the solar system", "stars",
    "telescopes", "microscopes", "computers", "binary numbers", "algorithms",
    "sorting lists", "recursion", "databases", "spreadsheets", "passwords and security",
    "encryption", "open source software", "version control with git", "the Python language",
    "regular expressions", "unit testing", "debugging", "clean code", "prime numbers",
    "fractions", "percentages", "probability", "geometry", "the Pythagorean theorem",
    "statistics", "maps and navigation", "time zones", "calendars", "languages of the world",
    "museums", "libraries", "democracy", "the scientific method", "critical thinking",
    "habits", "motivation", "kindness", "happiness", "the history of writing",
)

TEMPLATES = (
    "Explain {topic} in simple terms.",
    "Give me three interesting facts about {topic}.",
    "Write a short paragraph about {topic}.",
    "What are the most common misconceptions about {topic}?",
    "How would you explain {topic} to a ten-year-old?",
    "Write a haiku about {topic}.",
    "What should a beginner know about {topic}?",
    "List five questions people often ask about {topic}, with short answers.",
    "Summarize the key ideas of {topic} in a few bullet points.",
    "Write a short, friendly email to a colleague about {topic}.",
)

# A second pool (`chat_prompts(split, pool="more")`): new topics, and new kinds of request over
# every topic, so that a drafter trained on both sees more than one phrasing per topic. Its
# held-out prompts are split off by the same hash and never trained on.
MORE_TOPICS = (
    "tides", "earthquakes", "hurricanes", "rainbows", "clouds", "snow", "rivers", "caves",
    "the immune system", "the brain", "bones and muscles", "digestion", "antibiotics",
    "allergies", "eyesight", "hearing", "mushrooms", "trees", "flowers", "seeds", "ants",
    "butterflies", "penguins", "octopuses", "wolves", "horses", "farming", "irrigation",
    "fermentation", "soup", "spices", "vegetarian cooking", "home repairs", "painting a room",
    "houseplants", "bicycles", "electric cars", "public transport", "city planning",
    "lighthouses", "castles", "the Silk Road", "the Renaissance", "the Vikings",
    "ancient Greece", "the Moon landing", "the telephone", "radio", "television",
    "video games", "board games", "origami", "knitting", "pottery", "dance", "theater",
    "film making", "podcasts", "journalism", "advertising", "negotiation", "leadership",
    "parenting", "volunteering", "networking", "procrastination", "stress",
)

MORE_TEMPLATES = (
    "Why does {topic} matter in everyday life?",
    "Write a short dialogue between a teacher and a student about {topic}.",
    "Give me a step-by-step guide to getting started with {topic}.",
    "What is the history of {topic}, in brief?",
    "Compare two different ways of thinking about {topic}.",
    "Write a limerick about {topic}.",
    "What are the pros and cons of {topic}?",
    "Describe {topic} in exactly three sentences.",
    "Create a short quiz with three questions about {topic}, and give the answers.",
    "What would a world without {topic} look like?",
    "Give me a simple analogy that explains {topic}.",
    "Write a tweet-length summary of {topic}.",
    "What careers are connected to {topic}?",
    "Tell me a short story for children that involves {topic}.",
    "What are common mistakes people make with {topic}, and how can they avoid them?",
)

# A third pool (`pool="extra"`): more topics, more kinds of request, small worked problems with
# numbers, and code tasks from the public methods of standard-library classes.
EXTRA_TOPICS = (
    "the water supply of a city", "bread mold", "frogs", "owls", "spiders", "jellyfish",
    "the Amazon river", "the Sahara", "the Arctic", "mountains", "islands", "lakes", "wetlands",
    "air pollution", "noise", "light bulbs", "refrigerators", "microwaves", "washing machines",
    "3D printing", "robots", "drones", "satellites", "GPS", "the metric system", "money",
    "banks", "insurance", "renting an apartment", "buying a used car", "cooking eggs",
    "salad", "sandwiches", "pizza", "ice cream", "breakfast", "drinking water", "vitamins",
    "posture", "stretching", "walking", "cycling to work", "tennis", "basketball",
    "the Olympic Games", "marathons", "ballet", "jazz", "opera", "drums", "the piano",
    "comics", "animation", "fairy tales", "mythology", "pyramids", "the Great Wall of China",
    "the Aztecs", "the Industrial Age of steam", "trains", "ships", "submarines", "maps",
    "compasses", "weather forecasts", "thunderstorms", "fog", "wind", "the seasons",
    "sunsets", "the calendar", "clocks", "measuring time", "counting", "multiplication",
    "division", "negative numbers", "graphs", "averages", "logic puzzles", "riddles",
    "spreadsheets for a family budget", "web browsers", "search engines", "social media",
    "online privacy", "backups", "keyboards", "the command line", "HTML", "JSON",
    "the Linux operating system", "cloud computing", "machine learning", "chatbots",
)

EXTRA_TEMPLATES = (
    "Give me a checklist for {topic}.",
    "Write a four-line poem about {topic}.",
    "What questions should I ask an expert on {topic}?",
    "Write a short persuasive paragraph on why {topic} is worth learning about.",
    "What is the difference between a beginner and an expert in {topic}?",
    "Tell me a fun fact about {topic} and explain why it is true.",
    "Outline a five-minute presentation about {topic}.",
    "Write a news headline and a two-sentence story about {topic}.",
    "Explain {topic} using a metaphor about cooking.",
    "Write a short thank-you note to a teacher who taught me about {topic}.",
    "Answer in one sentence: what is {topic}?",
    "Give me two examples of {topic} in the real world.",
)

NUMBER_TEMPLATES = (
    "What is {a} plus {b}?",
    "What is {a} times {b}? Show your work.",
    "If I have {a} apples and give away {b}, how many are left?",
    "A train travels {a} kilometers in {b} hours. What is its average speed?",
    "Convert {a} degrees Celsius to Fahrenheit.",
    "What is {b} percent of {a}?",
    "Is {a} a prime number? Explain.",
    "A shop sells pens at {b} dollars each. How much do {a} pens cost?",
)

POOLS = ("base", "more", "extra")

# Asked of the target: its reply, stripped, is then a prompt of its own
QUESTION_REQUEST = ("Write one question that a curious person might ask about {topic}. Reply "
                    "with the question only.")


def held_out(prompt: str, fraction_in_ten: int = 1) -> bool:
    """Whether a prompt belongs to the held-out split (about fraction_in_ten / 10 of them)."""
    return int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 10 < fraction_in_ten


def templated_prompts() -> list[str]:
    return [t.format(topic=topic) for topic in TOPICS for t in TEMPLATES]


def more_prompts(num_code: int = 600) -> list[str]:
    """The second pool: new templates over all topics, the old templates over the new topics,
    and the code tasks after the first `num_code`."""
    return ([t.format(topic=topic) for topic in TOPICS + MORE_TOPICS for t in MORE_TEMPLATES]
            + [t.format(topic=topic) for topic in MORE_TOPICS for t in TEMPLATES]
            + code_tasks()[num_code:])


def extra_prompts() -> list[str]:
    """The third pool: its templates over its topics and the first ones', the second pool's
    templates over its topics, problems with numbers, and standard-library method tasks."""
    rng = random.Random(0)                      # the same numbers on every machine
    numbers = list(dict.fromkeys(t.format(a=rng.randint(2, 400), b=rng.randint(2, 60))
                                 for t in NUMBER_TEMPLATES for _ in range(30)))
    return ([t.format(topic=topic) for topic in EXTRA_TOPICS + TOPICS for t in EXTRA_TEMPLATES]
            + [t.format(topic=topic) for topic in EXTRA_TOPICS for t in MORE_TEMPLATES]
            + numbers + list(_stdlib_tasks()[1]))


def question_requests() -> list[str]:
    return [QUESTION_REQUEST.format(topic=topic) for topic in TOPICS]


def code_tasks(limit: int | None = None) -> list[str]:
    """'Write a Python function ...' from public standard-library functions with a one-line
    summary docstring (their signature and summary; never their body)."""
    return list(_stdlib_tasks()[0][:limit])


@functools.cache        # parsing the whole standard library takes ~15 s; its result never changes
def _stdlib_tasks() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The function tasks and the method tasks, in the files' order: public functions, and
    public methods of public classes (not tests), with a one-line docstring summary (their
    signature and summary; never their body); a method task once."""
    functions, methods = [], {}
    for path in Corpus.stdlib().train_files:
        try:
            with warnings.catch_warnings():     # old escapes in some files: not ours to fix
                warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
                tree = ast.parse(read_text(path))
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if (summary := _summary(node)) is not None:
                functions.append(f"Write a Python function `{node.name}({_args(node)})`. It "
                                 f"should do this: {summary}")
            if (not isinstance(node, ast.ClassDef) or node.name.startswith("_")
                    or "Test" in node.name or "Mixin" in node.name):
                continue
            for m in node.body:
                if (summary := _summary(m)) is not None and not m.name.startswith("test"):
                    methods[f"Write the method `{m.name}({_args(m)})` of a Python class "
                            f"`{node.name}`. It should do this: {summary}"] = None
    return tuple(functions), tuple(methods)


def _args(node: ast.FunctionDef) -> str:
    return ", ".join(a.arg for a in node.args.args)


def _summary(node: ast.AST) -> str | None:
    """A public function's one-line docstring summary, if it has a usable one."""
    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
        return None
    doc = ast.get_docstring(node)
    summary = doc.strip().split("\n")[0].strip() if doc else ""
    return summary if 20 <= len(summary) <= 120 and summary.endswith(".") else None


def chat_prompts(split: str, num_code: int = 600, pool: str = "base") -> list[str]:
    """The prompts of `split` ("train" or "heldout") in `pool` ("base": the templated prompts
    and code tasks; "more": `more_prompts`; "extra": `extra_prompts`), in a fixed order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
    everything = {"base": lambda: templated_prompts() + code_tasks(num_code),
                  "more": lambda: more_prompts(num_code), "extra": extra_prompts}[pool]()
    return [p for p in everything if held_out(p) == (split == "heldout")]
