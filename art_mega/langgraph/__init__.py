"""ART's LangGraph integration (`art.langgraph`): train a LangGraph agent written against
LangChain's chat-model interface.

    chat_model = init_chat_model(model.get_inference_name())   # inside the rollout
    agent = create_react_agent(chat_model, tools)
    ...
    trajectory = await wrap_rollout(model, rollout)(model, scenario)

`init_chat_model` (`chat_model.py`) gives LangChain's `ChatOpenAI` on the model's replica;
`wrap_rollout` (`rollout.py`) records each completion it makes, token ids and logprobs included,
into the trajectory the rollout returns. LangChain is imported only by `init_chat_model`: the
`langgraph` extra (`pip install 'art-mega[langgraph]'`).
"""

from art_mega.langgraph.chat_model import init_chat_model
from art_mega.langgraph.rollout import wrap_rollout

__all__ = ["init_chat_model", "wrap_rollout"]
