"""Tool calling on the OpenAI API: formats (parse + grammar) chosen by the model's template,
tool history through the template, streamed calls."""
