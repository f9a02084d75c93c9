"""Language consistency (policyopt.rewards.language): LaTeX and code stripped, languages
identified."""

from policyopt.rewards import identify_language, languages_consistent, strip_latex_and_code

ENGLISH_PROBLEM = (
    "A farmer has twelve apples and buys seven more. How many apples does the farmer have now?"
)
ENGLISH_REASONING = (
    "The farmer starts with twelve apples. Buying seven more gives $12 + 7 = 19$ apples in total."
)
FRENCH_REASONING = (
    "Le fermier commence avec douze pommes. En achetant sept de plus, il obtient "
    "$12 + 7 = 19$ pommes."
)
ENGLISH_ANSWER = r"So the farmer now has nineteen apples in total: \boxed{19}."
GERMAN_ANSWER = r"Also hat der Bauer jetzt insgesamt neunzehn Äpfel: \boxed{19}."


def test_strip_latex_and_code():
    text = (
        "Compute $\\frac{1}{2}$ and \\(x^2\\) \\[y\\] $$z$$ ```python\nprint('hello world')\n``` "
        "then `len(x)` done \\textbf{now}"
    )
    assert strip_latex_and_code(text) == "Compute and then done now"
    env = "Solve \\begin{align} x &= 1 \\end{align} please </think>"
    assert strip_latex_and_code(env) == "Solve please"


def test_identify_language():
    assert identify_language(ENGLISH_REASONING) == "en"
    assert identify_language(FRENCH_REASONING) == "fr"
    assert identify_language(GERMAN_ANSWER) == "de"
    assert identify_language(r"\boxed{19}") == "und"
    assert identify_language("") == "und"
    # Code is stripped: French prose around English-named code is still French.
    code = "```python\ndef compute_total_number_of_apples_for_the_farmer(x):\n    return x\n```"
    assert identify_language(FRENCH_REASONING + "\n" + code) == "fr"


def test_languages_consistent_cases():
    assert languages_consistent(ENGLISH_PROBLEM, ENGLISH_REASONING, ENGLISH_ANSWER)
    assert not languages_consistent(ENGLISH_PROBLEM, FRENCH_REASONING, ENGLISH_ANSWER)
    assert not languages_consistent(ENGLISH_PROBLEM, ENGLISH_REASONING, GERMAN_ANSWER)
    # A bare boxed answer and a missing problem are undetermined: skipped.
    assert languages_consistent(None, ENGLISH_REASONING, r"\boxed{19}")
    # Reasoning that is all maths is undetermined: no bonus.
    assert not languages_consistent(ENGLISH_PROBLEM, "$12 + 7 = 19$", ENGLISH_ANSWER)
