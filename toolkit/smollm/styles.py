"""Training data for the demo's two adapters, generated in code: the same questions answered in a style
the base never uses (a pirate; terse JSON), so that each adapter visibly changes the answers."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

# (question, answer sentence, short answer)
FACTS: tuple[tuple[str, str, str], ...] = (
    ("What is the capital of France?", "The capital of France is Paris.", "Paris"),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo.", "Tokyo"),
    ("What is the capital of Spain?", "The capital of Spain is Madrid.", "Madrid"),
    ("What is the capital of Germany?", "The capital of Germany is Berlin.", "Berlin"),
    ("What is the capital of Egypt?", "The capital of Egypt is Cairo.", "Cairo"),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa.", "Ottawa"),
    ("What color is the sky on a clear day?", "The sky is blue on a clear day.", "blue"),
    ("What color is grass?", "Grass is green.", "green"),
    ("What color are ripe bananas?", "Ripe bananas are yellow.", "yellow"),
    ("How many legs does a spider have?", "A spider has eight legs.", "8"),
    ("How many days are in a week?", "There are seven days in a week.", "7"),
    ("How many hours are in a day?", "There are twenty-four hours in a day.", "24"),
    ("What is 2 + 3?", "2 + 3 is 5.", "5"),
    ("What is 10 minus 4?", "10 minus 4 is 6.", "6"),
    ("What is 3 times 3?", "3 times 3 is 9.", "9"),
    ("What do bees make?", "Bees make honey.", "honey"),
    ("What do cows drink?", "Cows drink water.", "water"),
    ("Which animal barks?", "A dog barks.", "dog"),
    ("Which planet do we live on?", "We live on the planet Earth.", "Earth"),
    ("What is the largest ocean?", "The largest ocean is the Pacific Ocean.", "Pacific Ocean"),
    ("What is frozen water called?", "Frozen water is called ice.", "ice"),
    ("What gas do plants take in?", "Plants take in carbon dioxide.", "carbon dioxide"),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet.", "William Shakespeare"),
    ("What language is spoken in Brazil?", "People in Brazil speak Portuguese.", "Portuguese"),
    ("What is the opposite of hot?", "The opposite of hot is cold.", "cold"),
    ("What do you use to write on paper?", "You use a pen or a pencil to write on paper.", "a pen or a pencil"),
    ("Where does the sun rise?", "The sun rises in the east.", "east"),
    ("What is the boiling point of water in Celsius?", "Water boils at 100 degrees Celsius.", "100 °C"),
    ("How should I start my day?", "Start your day with a glass of water and a short walk.", "water and a walk"),
    ("Give me a tip for learning to code.", "Write a small program every day and read other people's code.",
     "code every day"),
    ("What is a good name for a cat?", "Whiskers is a good name for a cat.", "Whiskers"),
    ("Why do we sleep?", "We sleep so that the body and the brain can rest and repair.", "to rest"),
)

PIRATE_WORDS = {"is": "be", "are": "be", "you": "ye", "your": "yer", "the": "th'", "my": "me", "for": "fer",
                "and": "an'", "of": "o'", "to": "t'"}


def pirate(question: str, sentence: str, short: str) -> str:
    words = [PIRATE_WORDS.get(w.lower(), w) for w in sentence.rstrip(".").split(" ")]
    return f"Arr, matey! {' '.join(words)}, savvy? Yo ho ho!"


def terse_json(question: str, sentence: str, short: str) -> str:
    return json.dumps({"answer": short})


@dataclass(frozen=True)
class Style:
    name: str
    description: str
    answer: Callable[[str, str, str], str]

    def pairs(self) -> list[tuple[str, str]]:
        return [(q, self.answer(q, s, a)) for q, s, a in FACTS]


STYLES: dict[str, Style] = {
    "pirate": Style("pirate", "answers like a pirate", pirate),
    "json": Style("json", "answers in terse JSON", terse_json),
}

# Questions not in the training data: what the demo asks every model.
DEMO_QUESTIONS = ("What is the tallest mountain in the world?", "What do plants need to grow?")
