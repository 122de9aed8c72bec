"""Sixteen short chat questions with one clear answer each, and their prompts through a
model's chat template: what the cache-invariance test, the int8 chat gate and
benchmarks/chat_agreement.py ask."""

QUESTIONS = [
    "What is the capital of France?",
    "What is 2 + 2?",
    "Name a primary colour.",
    "What is the largest planet in the solar system?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Translate 'thank you' into Spanish.",
    "What gas do plants absorb from the air?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Name a mammal that can fly.",
    "What is the chemical symbol for gold?",
    "Which ocean is the largest?",
    "What language is spoken in Brazil?",
    "How many legs does a spider have?",
    "What is the square root of 81?",
]


def chat_prompts(tokenizer) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]
