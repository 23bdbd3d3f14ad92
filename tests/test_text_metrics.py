"""ROUGE-L in any script: the usual figure on ASCII text, identical answers score 1 in Chinese, Cyrillic, Greek."""

import pytest

from vlm_retrofit.text_metrics import rouge_l, rouge_tokens


def test_on_ascii_text_it_is_the_usual_rouge_l():
    from torchmetrics.functional.text.rouge import rouge_score

    predictions = ["A red apple, on a TABLE.", "two cats sleeping", "the the the", "x_y z", "nothing in common"]
    references = ["a red apple on the table", "a cat is sleeping on a mat", "the", "x y z", "entirely different"]
    usual = float(rouge_score(predictions, references, rouge_keys="rougeL")["rougeL_fmeasure"])
    assert rouge_l(predictions, references) == pytest.approx(usual, abs=1e-6)


@pytest.mark.parametrize("text", ["图片中有一只猫。", "На картинке кошка.", "Μια γάτα.", "고양이 한 마리", "Ein Café."])
def test_identical_answers_in_any_script_score_one(text):
    assert rouge_tokens(text)  # the usual normalisation (a-z0-9 only) leaves none of these but the German
    assert rouge_l([text], [text]) == 1.0


def test_unspaced_scripts_count_characters_and_empty_answers_agree_only_with_empty_ones():
    assert rouge_tokens("一只猫") == ["一", "只", "猫"]
    assert rouge_l(["一只猫"], ["一只狗"]) == pytest.approx(2 / 3)
    assert rouge_l([""], [""]) == 1.0 and rouge_l(["", "cat"], ["", ""]) == 0.5
    with pytest.raises(ValueError, match="2 predictions against 1 references"):
        rouge_l(["a", "b"], ["a"])
