"""Prompt rendering: the chat template for instruct models, plain text (bit for bit as before) otherwise."""

from __future__ import annotations

import asyncio
import random
import re
import shutil

import numpy as np
import pytest
from support import build_tiny_checkpoint, make_coordinator_dir, node_client, running_coordinator

from veriroll.coordinator.environments import Prompt, load_environment
from veriroll.coordinator.prompts import PromptRenderer, PromptRenderError, prompt_messages
from veriroll.protos.v1 import coordinator_pb2 as pb


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "v0")
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_plain_prompts_are_tokenized_exactly_as_before(tiny_tokenizer):
    renderer = PromptRenderer(tiny_tokenizer)  # "auto" and the char tokenizer has no template
    assert not renderer.uses_chat_template
    for p in load_environment("arithmetic", max_digits=3).sample_prompts(random.Random(0), 50):
        assert renderer.render(p) == list(tiny_tokenizer(p.text).input_ids)
    assert renderer.stop_token_ids([2]) == [2]


def test_chat_template_renders_messages_with_the_assistant_turn_open(smollm2_tokenizer):
    tok = smollm2_tokenizer
    renderer = PromptRenderer(tok)
    assert renderer.uses_chat_template
    p = Prompt(text="What is 2+3?", answer="5", env="t")
    ids = renderer.render(p)
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"), text
    assert ids == list(tok(tok.apply_chat_template(renderer.messages(p), add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False).input_ids)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_system_prompt_comes_first_and_replaces_the_templates_default(smollm2_tokenizer):
    tok = smollm2_tokenizer
    p = Prompt(text="Add 2 and 3.", answer="5", env="t")
    default = tok.decode(PromptRenderer(tok).render(p))
    assert "SmolLM" in default  # the template's own system turn when none is given
    text = tok.decode(PromptRenderer(tok, system_prompt="Answer with a number only.").render(p))
    assert text.startswith("<|im_start|>system\nAnswer with a number only.<|im_end|>\n<|im_start|>user\nAdd 2 and 3.")
    assert "SmolLM" not in text


def test_prompt_messages_are_used_when_given_and_keep_their_own_system_turn():
    p = Prompt(text="shown", answer="", env="t", messages=[{"role": "system", "content": "S"},
                                                          {"role": "user", "content": "U"}])
    assert prompt_messages(p, "ignored") == [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert prompt_messages(Prompt("hi", "", "t"), "sys") == [{"role": "system", "content": "sys"},
                                                            {"role": "user", "content": "hi"}]
    with pytest.raises(PromptRenderError, match="role"):
        prompt_messages(Prompt("x", "", "t", messages=[{"content": "no role"}]))


def test_never_gives_plain_text_even_with_a_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    renderer = PromptRenderer(tok, chat_template="never")
    assert renderer.render(Prompt("12+5=", "17", "t")) == list(tok("12+5=").input_ids)
    assert not renderer.uses_chat_template


def test_stop_tokens_add_the_end_of_turn_token_of_the_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    # With <|endoftext|> as the model's EOS, <|im_end|> (which ends the assistant's turn) stops too.
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    assert PromptRenderer(tok).stop_token_ids([endoftext]) == [endoftext, end_of_turn]
    assert PromptRenderer(tok).stop_token_ids([end_of_turn]) == [end_of_turn]
    assert PromptRenderer(tok, chat_template="never").stop_token_ids([endoftext]) == [endoftext]


def test_the_operators_stop_tokens_are_final_nothing_is_added(smollm2_tokenizer):
    tok = smollm2_tokenizer
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    assert PromptRenderer(tok).stop_token_ids([endoftext], override=[endoftext]) == [endoftext]
    assert PromptRenderer(tok).stop_token_ids([endoftext], override=(7, 9)) == [7, 9]


def test_with_an_override_leases_carry_exactly_the_override(tmp_path, smollm2_dir):
    """leases.stop_token_ids replaces the model's stop tokens, the chat template's end-of-turn included."""
    base = make_coordinator_dir(tmp_path, {"leases.stop_token_ids": [0]})
    version0 = base / "checkpoints" / "versions" / "v000000"
    shutil.rmtree(version0)
    version0.symlink_to(smollm2_dir, target_is_directory=True)  # only the tokenizer and config are read

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            lease = (await stub.lease_work(pb.LeaseRequest(max_leases=1, loaded_version=-1))).leases[0]
            return coord.service.renderer.uses_chat_template, list(lease.stop_token_ids)

    uses_chat_template, stops = asyncio.run(scenario())
    assert uses_chat_template and stops == [0]  # not [0, 2]: <|im_end|> is not added to the operator's list


def test_always_without_a_template_names_the_model_and_the_fix(tiny_tokenizer):
    with pytest.raises(PromptRenderError) as info:
        PromptRenderer(tiny_tokenizer, chat_template="always")
    message = str(info.value)
    assert tiny_tokenizer.name_or_path in message and "'never'" in message and "chat template" in message
    with pytest.raises(PromptRenderError, match="one of auto, always, never"):
        PromptRenderer(tiny_tokenizer, chat_template="sometimes")


def test_coordinator_refuses_to_start_with_always_and_a_base_tokenizer(tmp_path):
    base = make_coordinator_dir(tmp_path, {"environment.chat_template": "always"})

    async def start():
        async with running_coordinator(base):
            pass

    with pytest.raises(PromptRenderError, match="checkpoints/versions/v000000"):
        asyncio.run(start())


def test_a_real_instruct_model_gets_chat_prompts_and_math_rewards_end_to_end(tmp_path, smollm2_dir):
    """SmolLM2 as version 0, the math environment: the lease carries the chat-rendered word problem and
    <|im_end|> as a stop token, and the coordinator scores a boxed answer with math-verify."""
    base = make_coordinator_dir(tmp_path, {"environment.name": "math", "environment.kwargs": {"difficulty": 2},
                                           "environment.system_prompt": "You are a careful tutor.",
                                           "leases.max_new_tokens": 32})
    version0 = base / "checkpoints" / "versions" / "v000000"
    shutil.rmtree(version0)
    version0.symlink_to(smollm2_dir, target_is_directory=True)  # only the tokenizer and config are read

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            tok = coord.service.tokenizer
            end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
            lease = (await stub.lease_work(pb.LeaseRequest(max_leases=1, loaded_version=-1))).leases[0]
            text = tok.decode(list(lease.prompt_ids))
            assert text.startswith("<|im_start|>system\nYou are a careful tutor.<|im_end|>\n<|im_start|>user\n")
            assert text.endswith("Put the final answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
            assert end_of_turn in lease.stop_token_ids
            question = text.split("<|im_start|>user\n")[1].split("\n")[0]
            answer = coord.db.run_sync(lambda c: c.execute("SELECT answer FROM prompts").fetchone()[0])
            assert re.search(r"How many \w+", question) and int(answer) >= 1

            def sample(reply: str) -> pb.Sample:
                ids = tok(reply, add_special_tokens=False).input_ids + [end_of_turn]
                return pb.Sample(token_ids=ids, logprobs=np.full(len(ids), -1.0, dtype="<f4").tobytes(),
                                 proof=b"p", finish_reason="stop")

            replies = [f"So it is \\boxed{{{answer}}}.", f"The answer is {answer}", f"\\boxed{{{int(answer) + 1}}}",
                       "I am not sure."]
            ok = await stub.submit_group(pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=0,
                                                               samples=[sample(r) for r in replies]))
            assert ok.accepted and list(ok.rewards) == [1.0, 1.0, 0.0, 0.0]
            assert coord.service.metrics.reward_errors.get(kind="exception") == 0

    asyncio.run(scenario())
