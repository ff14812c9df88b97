"""ART's `complete_task_tool`: the tool a rollout offers besides the server's, which the policy
calls to end the task with a summary (`rollout_with_tools` stops at it)."""

from art_mega.mcp.types import MCPTool

complete_task_tool = MCPTool(
    name="complete_task",
    description="Finish the task and report what was done.",
    parameters={
        "type": "object",
        "properties": {"summary": {"type": "string", "description": "What was done and what it found."}},
        "required": ["summary"],
    },
)
