"""Instructions for self-distillation data, built offline: chat questions, code tasks, summaries.

Owns: the word lists and templates, and `instructions(num, seed, passages)`, which mixes
about a third each of chat questions, code tasks and texts to summarise. Chat questions
pair ~210 topics and ~80 everyday activities with ~30 question shapes (explain, advise,
compare, list, story, news ...); code tasks come from ~100 small programming tasks and from
the standard library's one-line docstrings (~900 in all with Python 3.11's library); texts
to summarise are paragraphs of the standard library's and /usr/share/doc's text (deduplicated),
plus ``passages``: prose from an earlier run's answers, since offline documentation holds few
stories. A smaller pool than asked for gives fewer instructions, not repeats.

A drafter learns what the target says to the kind of request it will serve, so variety
of requests is what the held-out acceptance needs (the first data had 360 distinct chat
questions, and its drafters overfit them). The benchmark prompts (benchmarks/prompts*.json)
are kept apart: no instruction is one of them or names a subject in `HELD_OUT` (tested);
neighbouring subjects remain (other instruments, remote work, camping).

Does not own: answering them (regenerate.py).
"""

from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
from collections.abc import Sequence
from pathlib import Path

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "vaccines", "inflation",
    "machine learning", "the immune system", "plate tectonics", "the Roman Empire", "climate change",
    "blockchains", "the printing press", "DNA replication", "supply and demand", "volcanoes", "electric cars",
    "the internet", "jazz music", "the Renaissance", "antibiotics", "solar panels", "the Moon landing",
    "compound interest", "sleep", "coffee", "honeybees", "the stock market", "recycling", "earthquakes",
    "the human heart", "neural networks", "the Olympic Games", "democracy", "rainbows", "tides", "gravity",
    "the Great Wall of China", "chess", "meditation", "nuclear energy", "the Industrial Revolution", "bread making",
    "public speaking", "time management", "the theory of evolution", "operating systems", "databases",
    "encryption", "the speed of light", "glaciers", "coral reefs", "the ancient Egyptians", "hurricanes",
    "the metric system", "electricity", "magnets", "the periodic table", "vitamins", "wind turbines",
    "the solar system", "dinosaurs", "the Silk Road", "the Cold War", "the human brain", "memory",
    "habits", "procrastination", "dogs", "horses", "dolphins", "owls", "octopuses", "penguins", "whales",
    "ants", "butterflies", "sharks", "elephants", "wolves", "bats", "mushrooms", "trees", "rainforests",
    "deserts", "the ocean", "rivers", "lightning", "snow", "clouds", "the seasons", "the Sun", "Mars",
    "comets", "telescopes", "microscopes", "the wheel", "bridges", "skyscrapers", "airplanes", "trains",
    "bicycles", "rockets", "satellites", "GPS", "smartphones", "batteries", "3D printing", "robots",
    "video games", "social media", "email", "cloud computing", "open-source software", "password security",
    "spreadsheets", "the history of writing", "libraries", "museums", "the Vikings", "the Maya", "the Aztecs",
    "ancient Greece", "the Ottoman Empire", "the Byzantine Empire", "medieval castles", "samurai", "pirates",
    "the Wright brothers", "Marie Curie", "Isaac Newton", "Albert Einstein", "Ada Lovelace", "Leonardo da Vinci",
    "Shakespeare's plays", "poetry", "opera", "classical music", "hip hop", "photography", "film making",
    "painting with watercolors", "origami", "knitting", "pottery", "architecture", "urban planning",
    "public transport", "taxes", "budgeting", "credit scores", "insurance", "small businesses", "marketing",
    "job interviews", "remote work", "teamwork", "leadership", "negotiation", "friendship", "parenting",
    "nutrition", "exercise", "yoga", "running", "swimming", "football", "basketball", "tennis", "cricket",
    "the marathon", "chocolate", "tea", "cheese", "spices", "fermentation", "vegetarian diets", "sugar",
    "water pollution", "air quality", "plastic waste", "composting", "endangered species", "national parks",
    "bird migration", "the food chain", "soil", "irrigation", "farming", "hydropower", "geothermal energy",
    "the placebo effect", "allergies", "the common cold", "dreams", "emotions", "language learning",
    "sign language", "the alphabet", "prime numbers", "probability", "statistics", "geometry", "algebra",
    "infinity", "fractals", "maps", "time zones", "calendars", "clocks", "money", "banks", "trade",
    "the United Nations", "elections", "human rights", "the justice system", "journalism", "advertising",
)  # fmt: skip
ACTIVITIES = (
    "learning to cook", "running a first 5k race", "starting a vegetable garden", "saving money for a house",
    "learning a new language", "keeping a journal", "studying for exams", "moving to a new city",
    "starting a small business", "learning to swim", "training a puppy", "writing a novel",
    "getting better sleep", "learning to draw", "taking care of houseplants", "planning a wedding",
    "preparing for a job interview", "learning to code", "reducing screen time", "making new friends",
    "learning to knit", "baking sourdough bread", "starting a podcast", "becoming a morning person",
    "decluttering a home", "learning photography", "cycling to work", "teaching a child to read",
    "organizing a birthday party", "learning chess", "building a personal website", "eating more vegetables",
    "learning to meditate", "volunteering", "buying a used car", "renting a first apartment",
    "working from home", "managing stress", "learning to dance", "starting to lift weights",
    "visiting Japan for the first time", "planning a road trip", "camping with children", "learning to sail",
    "writing a cover letter", "giving a toast at a wedding", "learning to ski", "brewing coffee at home",
    "keeping chickens", "learning the piano", "painting a room", "fixing a leaky faucet",
    "learning to juggle", "starting a book club", "caring for an elderly parent", "adopting a rescue dog",
    "learning to type faster", "preparing a presentation", "applying to university", "learning to budget",
    "keeping a fish tank", "growing tomatoes", "making pasta from scratch", "learning to skateboard",
    "training for a triathlon", "learning to play the drums", "taking better photos with a phone",
    "starting a YouTube channel", "learning to sew", "planning meals for a week", "learning to ice skate",
    "staying focused while studying", "traveling on a tight budget", "hosting a dinner party",
    "learning to rock climb", "starting a compost bin", "learning Spanish", "writing poetry",
)  # fmt: skip
CHAT_TEMPLATES = (
    "Explain {t} to a high-school student.",
    "What are the most important facts about {t}?",
    "Give me three interesting questions about {t} and answer each one.",
    "Write a short blog post about {t}.",
    "What are common misconceptions about {t}?",
    "Describe the history of {t} in a few paragraphs.",
    "Explain {t} in simple terms.",
    "Why is {t} important? Answer in a few paragraphs.",
    "What is {t}, and how does it work?",
    "Tell me five fun facts about {t}.",
    "Write a short poem about {t}.",
    "Write a short story that involves {t}.",
    "How would you explain {t} to a ten-year-old?",
    "What are the pros and cons of {t}?",
    "Write a paragraph for an encyclopedia about {t}.",
    "What questions do scientists still have about {t}?",
    "Summarize what everyone should know about {t} in a short list.",
    "I'm curious about {t}. Where should I start?",
)
ADVICE_TEMPLATES = (
    "Give me some advice for {a}.",
    "What should I know before {a}?",
    "How do I get started with {a}?",
    "What are the most common mistakes people make when {a}?",
    "Make a simple one-week plan for {a}.",
    "I'm nervous about {a}. Any tips?",
    "What do I need for {a}? Give me a checklist.",
    "Write a short motivational message for someone who is {a}.",
    "What are the benefits of {a}?",
    "Describe a typical first month of {a}.",
)
PAIR_TEMPLATES = (
    "What is the difference between {a} and {b}?",
    "Compare {a} and {b} in a short table and a paragraph.",
    "Which is more interesting, {a} or {b}? Argue both sides.",
)
NEWS_TEMPLATES = (
    "Write a short local news report about {e}.",
    "Write a short announcement about {e}.",
    "Write a short magazine article about {e}.",
)
EVENTS = (
    "a new library opening in a small town", "a school science fair", "a bakery that won a national award",
    "a city's plan to plant ten thousand trees", "a power outage during a storm", "a marathon held in the rain",
    "a museum returning a stolen painting", "a company switching to a four-day work week",
    "a farmers market moving to a new location", "a rescued whale released back to the sea",
    "a new bus route connecting two villages", "a hospital opening a new children's wing",
    "a high school robotics team reaching the finals", "a water main break downtown",
    "a village festival celebrating its harvest", "a student inventing a cheap water filter",
    "a bridge closed for repairs", "a zoo welcoming a baby giraffe", "a record heat wave",
    "a local football club promoted to a higher league", "a new recycling program for apartments",
    "a startup launching a delivery robot", "a university discovering a new species of frog",
    "a town voting on a new skate park", "a flood damaging a historic street", "a concert raising money for a shelter",
    "a train line reopening after fifty years", "an airport adding night flights", "a chess champion aged twelve",
    "a community garden expanding", "a factory closing and workers retraining", "a new law on e-scooters",
    "a solar farm built on an old landfill", "a mountain rescue after an avalanche", "a sea turtle nesting season",
    "a theater reopening after renovation", "a coffee shop run by volunteers", "a lost dog found after a month",
)  # fmt: skip
CODE_TASKS = (
    "reverses the words in a sentence", "computes the factorial of n iteratively and recursively",
    "merges two sorted lists into one sorted list", "finds the second largest number in a list",
    "checks whether a number is prime", "returns the first n Fibonacci numbers", "flattens a nested list",
    "removes duplicates from a list while keeping the order", "converts Celsius to Fahrenheit and back",
    "finds the longest common prefix of a list of strings", "counts the vowels in a string",
    "checks whether two strings are anagrams", "rotates a list by k positions", "computes the median of a list",
    "implements binary search on a sorted list", "implements bubble sort", "implements merge sort",
    "implements quicksort", "transposes a matrix given as a list of lists", "multiplies two matrices",
    "converts a Roman numeral to an integer", "converts an integer to a Roman numeral",
    "validates an email address with a regular expression", "parses a CSV file and sums one column",
    "reads a JSON file and prints its keys", "groups a list of words by their first letter",
    "computes the greatest common divisor of two numbers", "generates all permutations of a string",
    "generates all subsets of a list", "checks whether parentheses in a string are balanced",
    "finds the most frequent element in a list", "chunks a list into pieces of size n",
    "computes a running average of a stream of numbers", "formats a number of seconds as hours:minutes:seconds",
    "converts a string to title case without using str.title", "capitalizes the first letter of every sentence",
    "finds all pairs in a list that add up to a target", "computes the sum of the digits of a number",
    "checks whether a year is a leap year", "returns the n largest items of a list using heapq",
    "implements a stack with push, pop and peek", "implements a queue with two stacks",
    "implements a simple linked list with append and delete", "computes the edit distance between two strings",
    "finds the longest increasing subsequence", "solves the two-sum problem with a dictionary",
    "generates a random password of a given length", "simulates rolling two dice 1000 times",
    "draws a text histogram of a list of numbers", "converts a binary string to an integer",
    "compresses a string with run-length encoding", "decodes a run-length encoded string",
    "finds the intersection of two lists", "computes the dot product of two vectors",
    "normalizes a list of numbers to the range 0 to 1", "finds the index of the maximum value",
    "splits a full name into first and last name", "calculates compound interest",
    "computes the area and perimeter of a rectangle", "converts a dictionary to a list of tuples sorted by value",
    "counts the lines in a file", "finds all files with a given extension in a directory",
    "renames all files in a folder to lowercase", "downloads nothing but pretends to with a progress bar",
    "caches the results of an expensive function", "measures how long a function takes to run",
    "retries a function up to three times when it raises", "implements a simple command-line calculator",
    "parses command-line arguments with argparse", "implements FizzBuzz", "prints a multiplication table",
    "checks whether a list is sorted", "finds the missing number in a list from 1 to n",
    "computes the power set of a set", "implements a binary tree with insert and search",
    "does a breadth-first search on a graph given as a dictionary", "does a depth-first search on a grid",
    "finds the shortest path in a maze", "implements Dijkstra's algorithm", "computes prime numbers with a sieve",
    "shuffles a list with the Fisher-Yates algorithm", "converts a hex color to RGB",
    "checks whether a sudoku row is valid", "plays rock, paper, scissors against the computer",
    "implements a simple to-do list in memory", "implements a number guessing game",
    "reads temperatures from a file and prints the average", "sorts a list of dictionaries by a key",
    "merges two dictionaries", "inverts a dictionary", "counts characters with collections.Counter",
)  # fmt: skip
CLASS_TEMPLATES = (
    "Write a Python class for a {c}, with a few methods and a short usage example.",
    "Write a Python dataclass for a {c} and a function that validates it.",
)
CLASS_THINGS = (
    "library book", "shopping cart", "temperature sensor", "playing card deck", "stopwatch", "recipe",
    "student with grades", "parking garage", "hotel reservation", "music playlist", "rectangle and circle",
    "todo list", "pet shop", "traffic light", "thermostat", "chess piece", "employee record",
    "movie rating", "address book", "vending machine", "elevator", "train schedule", "to-do item with a due date",
)  # fmt: skip
# the subjects of the benchmark prompts: no instruction built here may mention them
HELD_OUT = ("cat", "guitar", "hiking", "hike", "backpacking", "palindrome", "palindromic", "bank account",
            "ten most common", "bicycle lane", "bike lane", "lizard", "hybrid working", "sky is blue",
            "robot who learns to paint", "lists and tuples", "inventory", "most common word", "word count",
            "should I pack", "to pack", "packing")  # fmt: skip
_HELD_OUT_WORDS = re.compile(r"\b(" + "|".join(re.escape(w) for w in HELD_OUT) + r")s?\b", re.IGNORECASE)
# A code task can be near a benchmark code prompt (a palindrome check ignoring punctuation, a bank
# account class, a script printing a text file's ten most common words) without naming its subject:
# "a dictionary mapping each word to its frequency", "remove all punctuation from a string". In a
# request for Python, these are held out too (code only: "the top 10 fitness apps" is no such request).
_PYTHON = re.compile(r"\bPython\b", re.IGNORECASE)
_NEAR_CODE = re.compile(
    r"palindrom|reads? the same|same (forwards|backwards)|\[::-1\]|punctuation|\bbank|deposit|withdraw|\btext files?\b"
    r"|\bwords?\b.*(frequen|count|occurr|number of|how many|tally|common)"
    r"|(frequen|count|occurr|number of|how many|tally|common).*\bwords?\b",
    re.IGNORECASE,
)


def names_held_out(text: str) -> bool:
    """Whether ``text`` names a benchmark prompt's subject (a whole word of `HELD_OUT`, or its plural),
    or asks for Python code near a benchmark code prompt's (`_NEAR_CODE`)."""
    if _HELD_OUT_WORDS.search(text) is not None:
        return True
    return _PYTHON.search(text) is not None and _NEAR_CODE.search(text) is not None


@functools.cache
def _stdlib_modules() -> tuple[ast.Module, ...]:
    """The standard library's public top-level modules, parsed once for code tasks and paragraphs."""
    root = Path(sysconfig.get_paths()["stdlib"])
    modules = []
    for path in sorted(p for p in root.glob("*.py") if not p.name.startswith("_")):
        try:
            modules.append(ast.parse(path.read_text(encoding="utf-8", errors="replace")))
        except SyntaxError:
            continue
    return tuple(modules)


def chat_questions() -> list[str]:
    """Every chat question the lists make (topics, activities, pairs of neighbouring topics, news)."""
    out = [t.format(t=topic) for topic in TOPICS for t in CHAT_TEMPLATES]
    out += [t.format(a=a) for a in ACTIVITIES for t in ADVICE_TEMPLATES]
    out += [t.format(a=a, b=b) for a, b in zip(TOPICS[::2], TOPICS[1::2]) for t in PAIR_TEMPLATES]
    out += [t.format(e=e) for e in EVENTS for t in NEWS_TEMPLATES]
    return out


def code_tasks(rng: random.Random, n: int) -> list[str]:
    """Small programming tasks from `CODE_TASKS` / `CLASS_THINGS`, and "Write a Python function
    `name(args)`" from standard-library functions' one-line docstrings, shuffled."""
    tasks = [f"Write a Python function that {t}." for t in CODE_TASKS]
    tasks += [f"Write a Python function that {t}, with a few tests." for t in CODE_TASKS]
    tasks += [t.format(c=c) for c in CLASS_THINGS for t in CLASS_TEMPLATES]
    for tree in _stdlib_modules():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
                if 20 <= len(doc) <= 160:
                    args = ", ".join(a.arg for a in node.args.args)
                    tasks.append(f"Write a Python function `{node.name}({args})`. {doc} Include a short example.")
    tasks = list(dict.fromkeys(tasks))  # a name documented twice in the library makes one task
    rng.shuffle(tasks)
    return tasks[:n]


def paragraphs(rng: random.Random, n: int, passages: Sequence[str] = ()) -> list[str]:
    """``passages`` of 300-1500 characters first, then paragraphs of 300-1200 characters from
    module docstrings and /usr/share/doc text files, shuffled, at most ``n``."""
    own = list(dict.fromkeys(p.strip() for p in passages if 300 <= len(p.strip()) <= 1500))
    found = []
    for tree in _stdlib_modules():
        doc = ast.get_docstring(tree) or ""
        found += [p for p in doc.split("\n\n") if 300 <= len(p) <= 1200]
    for path in sorted(Path("/usr/share/doc").glob("*/*"))[:2000]:
        if path.is_file() and path.suffix in ("", ".txt", ".md") and path.stat().st_size < 200_000:
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [p for p in text.split("\n\n") if 300 <= len(p) <= 1200 and p.count(" ") > 40]
    found = list(dict.fromkeys(found))  # licence texts repeat across /usr/share/doc
    rng.shuffle(own)
    rng.shuffle(found)
    picked = own[: (2 * n) // 3] if found else own[:n]  # narrative first, but keep some documentation
    picked += found[: n - len(picked)]
    rng.shuffle(picked)
    return picked


def instructions(num: int, seed: int, passages: Sequence[str] = ()) -> list[str]:
    """About a third each of chat questions, code tasks and summaries, shuffled."""
    rng = random.Random(seed)
    chat = chat_questions()
    rng.shuffle(chat)
    third = num // 3
    summaries = [f"Summarize the following text in a few sentences:\n\n{p}" for p in paragraphs(rng, third, passages)]
    out = chat[: num - 2 * third] + code_tasks(rng, third) + summaries
    rng.shuffle(out)
    return out
