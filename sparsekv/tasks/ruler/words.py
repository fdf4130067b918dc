"""Word lists of the RULER-style generators: haystack sentences, needle keys, variable names, list words.

Plain lowercase English words; the lists are disjoint (a key never occurs in the haystack) so that a needle's
key is found only in its needle. VAR_NAMES are fixed five-letter uppercase names.
"""
from __future__ import annotations

import random
import string

NOUNS = (
    "apple", "basket", "bridge", "cabin", "camera", "carpet", "cart", "chair", "cloud", "coat", "cookie",
    "corner", "cottage", "cup", "desk", "door", "dragon", "drum", "engine", "farmer", "feather", "fence",
    "field", "flower", "fountain", "garage", "gate", "giant", "glove", "goat", "guitar", "hammer", "hat",
    "helmet", "hill", "horse", "island", "jacket", "kettle", "kitchen", "ladder", "lake", "lamp", "letter",
    "library", "lion", "market", "mirror", "monkey", "needle", "nest", "painter", "palace", "parrot", "path",
    "pencil", "piano", "picture", "pillow", "pirate", "plate", "pocket", "pond", "potato", "puppet", "rabbit",
    "radio", "robot", "rock", "roof", "sailor", "school", "shadow", "sheep", "shelf", "ship", "shoe", "singer",
    "soldier", "spoon", "stair", "station", "stone", "street", "student", "sugar", "table", "teacher", "tent",
    "tiger", "tower", "town", "toy", "tractor", "train", "tree", "truck", "tunnel", "turtle", "valley",
    "wagon", "wall", "whale", "wheel", "wizard", "wolf", "worker", "yard",
)

ADJECTIVES = (
    "ancient", "bold", "brave", "bright", "broken", "busy", "calm", "careful", "cheerful", "clean", "clever",
    "cold", "curious", "dark", "dusty", "eager", "empty", "fancy", "famous", "fast", "friendly", "gentle",
    "glad", "golden", "grumpy", "happy", "heavy", "hollow", "honest", "huge", "hungry", "little",
    "lonely", "loud", "lucky", "modern", "muddy", "narrow", "noisy", "old", "orange", "patient", "plain",
    "polite", "proud", "purple", "quick", "quiet", "rainy", "rapid", "rough", "round", "rusty", "sandy",
    "shiny", "short", "silent", "sleepy", "slow", "small", "smooth", "soft", "sturdy", "sunny", "tall",
    "tiny", "tired", "warm", "wet", "wide", "wild", "windy", "wise", "wooden", "young",
)

VERBS = (
    "admired", "avoided", "borrowed", "built", "carried", "chased", "cleaned", "climbed", "covered", "crossed",
    "drew", "dropped", "fixed", "followed", "found", "guarded", "helped", "hid", "kicked", "lifted", "liked",
    "moved", "noticed", "opened", "painted", "passed", "pulled", "pushed", "reached", "repaired", "saw",
    "shared", "showed", "sold", "sorted", "touched", "visited", "washed", "watched", "wrapped",
)

ADVERBS = (
    "again", "slowly", "quickly", "quietly", "happily", "gently", "early", "later", "today", "yesterday",
    "twice", "carefully", "suddenly", "together", "outside", "inside",
)

# Needle keys: never used in the haystack.
KEYS = (
    "amber", "anchor", "arrow", "aurora", "badge", "banjo", "beacon", "biscuit", "blossom", "breeze", "bucket",
    "button", "cactus", "candle", "canyon", "castle", "cedar", "cherry", "cinnamon", "citrus", "clover",
    "cobalt", "comet", "compass", "copper", "coral", "cricket", "crystal", "cypress", "daisy", "delta",
    "diamond", "dolphin", "ember", "emerald", "falcon", "fern", "ferry", "fiddle", "galaxy", "garnet",
    "ginger", "glacier", "granite", "harbor", "harvest", "hazel", "heron", "hickory", "indigo", "iris",
    "ivory", "jade", "jasmine", "jigsaw", "juniper", "kayak", "kiwi", "lagoon", "lantern", "lava", "lemon",
    "lilac", "lotus", "magnet", "mango", "maple", "marble", "meadow", "meteor", "mint", "mosaic", "nectar",
    "nickel", "nova", "nutmeg", "oasis", "olive", "onyx", "opal", "orbit", "orchid", "otter", "paddle",
    "panda", "pebble", "pepper", "pixel", "planet", "plume", "poppy", "prism", "pumpkin", "quartz", "quill",
    "raven", "reef", "ribbon", "saddle", "saffron", "sapphire", "satin", "sequoia", "sparrow", "spruce",
    "thistle", "thunder", "topaz", "tulip", "velvet", "violet", "violin", "walnut", "willow", "zephyr",
)

# Words of the common-words lists: the haystack vocabulary, four letters or more (a short word could be
# found inside a longer one by the whitespace-insensitive scorer).
LIST_WORDS = tuple(sorted({w for w in NOUNS + ADJECTIVES + VERBS if len(w) >= 4}))


def _var_names(count: int, seed: int = 20240601) -> tuple[str, ...]:
    rng = random.Random(seed)
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < count:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in seen and name != "VALUE":
            seen.add(name)
            names.append(name)
    return tuple(names)


VAR_NAMES = _var_names(400)
