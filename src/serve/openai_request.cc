#include "serve/openai_request.h"

#include <fmt/core.h>

#include <algorithm>
#include <climits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "core/json_fields.h"
#include "tokenizer/prompt.h"

namespace ferry::serve {

namespace {

using Json = nlohmann::json;

// A JSON integer that is a token id of `tk`, or nothing.
std::optional<int32_t> TokenId(const Json& v, const tokenizer::Tokenizer& tk) {
    const int64_t id = JsonFields::ClampedInt(v);
    if (id < 0 || id >= tk.vocab_size()) return std::nullopt;
    return static_cast<int32_t>(id);
}

// Reads optional typed fields, remembering the first error.
// The request's fields, read through JsonFields (absent and null: not given); a failure is
// worded as OpenAI clients see it ("'max_tokens' must be an integer, not a string") and names
// its param.
class Fields {
  public:
    explicit Fields(const Json& body) : body_(body), f_(body) {}
    bool ok() const { return !error_.has_value(); }
    const BadRequest& error() const { return *error_; }
    void Fail(std::string message, std::string param, std::string code = "") {
        if (!error_) error_ = BadRequest{std::move(message), std::move(param), std::move(code)};
    }
    bool Has(const char* key) const { return f_.Given(key) != nullptr; }

    void Number(const char* key, double* out, double lo, double hi) {
        auto v = f_.OptNumber(key);
        if (!v.ok()) return WrongType(key, "a number");
        if (!*v) return;
        const double d = **v;
        if (!(d >= lo && d <= hi)) {
            return Fail(fmt::format("'{}' is {}; it must be between {} and {}", key, d, lo, hi),
                        key);
        }
        *out = d;
    }
    void Int(const char* key, int64_t* out, int64_t lo, int64_t hi) {
        auto v = f_.OptInt(key, INT64_MIN, INT64_MAX);
        if (!v.ok()) {
            // An integer beyond int64 is out of range, not of the wrong type.
            if (body_[key].is_number_unsigned()) {
                return Fail(fmt::format("'{}' is {}; it must be between {} and {}", key,
                                        body_[key].get<uint64_t>(), lo, hi),
                            key);
            }
            return WrongType(key, "an integer");
        }
        if (!*v) return;
        const int64_t i = **v;
        if (i < lo || i > hi) {
            return Fail(fmt::format("'{}' is {}; it must be between {} and {}", key, i, lo, hi),
                        key);
        }
        *out = i;
    }
    void Bool(const char* key, bool* out) {
        auto v = f_.OptBool(key);
        if (!v.ok()) return WrongType(key, "a boolean");
        if (*v) *out = **v;
    }
    void String(const char* key, std::string* out) {
        auto v = f_.OptString(key, SIZE_MAX);
        if (!v.ok()) return WrongType(key, "a string");
        if (*v) *out = std::move(**v);
    }

  private:
    void WrongType(const char* key, const char* want) {
        Fail(fmt::format("'{}' must be {}, not {}", key, want, JsonFields::KindOf(body_[key])),
             key);
    }

    const Json& body_;
    const JsonFields f_;
    std::optional<BadRequest> error_;
};

// The "model" field, if given, must name the served model.
void CheckModel(Fields* f, const std::string& model_name) {
    std::string model;
    f->String("model", &model);
    if (f->ok() && !model.empty() && model != model_name) {
        f->Fail(fmt::format("The model `{}` does not exist; this server serves `{}`", model,
                            model_name),
                "model", "model_not_found");
    }
}

// Fields of the OpenAI API (and vLLM's extensions) that ferry does not implement: a request
// that sets one to anything but its no-op value is refused naming it, rather than answered as
// if it had not been asked (docs/inference.md lists them). Unknown fields are ignored, as vLLM
// and SGLang do.
struct Unimplemented {
    const char* field;
    const char* why;
    bool (*asks)(const Json& v);  // whether this value asks for something (null: never)
};
bool NonEmpty(const Json& v) {
    return !v.is_null() && !(v.is_array() && v.empty()) && !(v.is_object() && v.empty()) &&
           !(v.is_string() && v.get<std::string>().empty()) && !(v.is_boolean() && !v.get<bool>());
}
bool NotText(const Json& v) {  // response_format: {"type": "text"} is the default
    return !v.is_null() && !(v.is_object() && v.contains("type") && v["type"] == "text");
}
bool NotNoneOrAuto(const Json& v) {  // tool_choice without tools
    return !v.is_null() && v != "none" && v != "auto";
}
bool NotOne(const Json& v) { return !v.is_null() && !(v.is_number() && v.get<double>() == 1); }
bool NotZero(const Json& v) { return !v.is_null() && !(v.is_number() && v.get<double>() == 0); }
bool NotTrue(const Json& v) { return !v.is_null() && v != true; }
bool NotTextOnly(const Json& v) {  // modalities: ["text"] is the default
    return !v.is_null() && v != Json::array({"text"});
}
bool OverOne(const Json& v) { return !v.is_null() && !(v.is_number() && v.get<double>() <= 1); }
constexpr Unimplemented kUnimplemented[] = {
    {"response_format", "structured output (JSON mode, JSON schema) is not implemented", NotText},
    {"tools", "tool calling is not implemented", NonEmpty},
    {"tool_choice", "tool calling is not implemented", NotNoneOrAuto},
    {"functions", "function calling is not implemented", NonEmpty},
    {"function_call", "function calling is not implemented", NotNoneOrAuto},
    {"logit_bias", "logit bias is not implemented", NonEmpty},
    {"best_of", "best_of above 1 is not implemented", OverOne},
    {"use_beam_search", "beam search is not implemented", NonEmpty},
    {"min_p", "min_p sampling is not implemented (only 0)", NotZero},
    {"repetition_penalty", "repetition_penalty is not implemented (only 1)", NotOne},
    {"length_penalty", "length_penalty is not implemented (only 1)", NotOne},
    {"min_tokens", "min_tokens is not implemented (only 0)", NotZero},
    {"guided_json", "guided decoding is not implemented", NonEmpty},
    {"guided_regex", "guided decoding is not implemented", NonEmpty},
    {"guided_choice", "guided decoding is not implemented", NonEmpty},
    {"guided_grammar", "guided decoding is not implemented", NonEmpty},
    {"structured_outputs", "structured output is not implemented", NonEmpty},
    {"prompt_logprobs", "prompt logprobs are not implemented", NonEmpty},
    {"allowed_token_ids", "allowed_token_ids is not implemented", NonEmpty},
    {"bad_words", "bad_words is not implemented", NonEmpty},
    {"logits_processors", "logits processors are not implemented", NonEmpty},
    {"audio", "audio output is not implemented", NonEmpty},
    {"modalities", "only text output is implemented", NotTextOnly},
    {"prediction", "predicted outputs are not implemented", NonEmpty},
    {"include_stop_str_in_output", "include_stop_str_in_output is not implemented", NonEmpty},
    {"skip_special_tokens", "skip_special_tokens false is not implemented", NotTrue},
    {"spaces_between_special_tokens", "spaces_between_special_tokens false is not implemented",
     NotTrue},
    {"truncate_prompt_tokens", "truncate_prompt_tokens is not implemented", NonEmpty},
    {"lora_request", "LoRA adapters are not implemented", NonEmpty},
};

void RefuseUnimplemented(const Json& body, Fields* f) {
    for (const Unimplemented& u : kUnimplemented) {
        if (!f->ok()) return;
        auto it = body.find(u.field);
        if (it == body.end() || !u.asks(*it)) continue;
        f->Fail(fmt::format("'{}' is not supported by this server: {}", u.field, u.why), u.field,
                "unsupported_parameter");
    }
}

// Fills `out` from a /v1/completions or /v1/chat/completions body.
void ParseRequest(const Json& body, bool chat, const tokenizer::Tokenizer& tk,
                  const std::string& model_name, ParsedRequest* out, Fields* f,
                  const tokenizer::ImageTokens* image_tokens) {
    out->chat = chat;
    CheckModel(f, model_name);
    RefuseUnimplemented(body, f);
    model::SamplingParams& sp = out->sampling;
    int64_t max_tokens = chat ? -1 : 16;
    f->Int("max_tokens", &max_tokens, 1, 1 << 30);
    if (chat) f->Int("max_completion_tokens", &max_tokens, 1, 1 << 30);
    double temperature = 1.0, top_p = 1.0;
    f->Number("temperature", &temperature, 0, 2);
    f->Number("top_p", &top_p, 1e-9, 1);
    int64_t top_k = -1, n = 1;
    f->Int("top_k", &top_k, -1, 1 << 24);
    f->Int("n", &n, 1, 1);
    int64_t seed = -1;
    if (f->Has("seed")) {
        f->Int("seed", &seed, INT64_MIN, INT64_MAX);
        if (f->ok()) sp.seed = static_cast<uint64_t>(seed);
    }
    f->Bool("stream", &out->stream);
    f->Bool("return_tokens_as_token_ids", &out->tokens_as_ids);
    f->Bool("return_token_ids", &out->return_token_ids);
    f->Bool("ignore_eos", &sp.ignore_eos);
    double penalty = 0;
    for (const char* k : {"presence_penalty", "frequency_penalty"}) {
        f->Number(k, &penalty, -2, 2);
        if (f->ok() && penalty != 0) f->Fail(fmt::format("'{}' is not supported (only 0)", k), k);
    }
    if (f->Has("stream_options")) {
        const Json& so = body["stream_options"];
        if (!so.is_object()) {
            f->Fail("'stream_options' must be an object", "stream_options");
        } else if (so.contains("include_usage")) {
            if (!so["include_usage"].is_boolean()) {
                f->Fail("'stream_options.include_usage' must be a boolean",
                        "stream_options.include_usage");
            } else {
                out->include_usage = so["include_usage"].get<bool>();
            }
        }
    }
    if (f->Has("stop")) {
        const Json& s = body["stop"];
        if (s.is_string()) {
            sp.stop.push_back(s.get<std::string>());
        } else if (s.is_array() &&
                   std::all_of(s.begin(), s.end(), [](const Json& e) { return e.is_string(); })) {
            for (const Json& e : s) sp.stop.push_back(e.get<std::string>());
        } else {
            f->Fail("'stop' must be a string or an array of strings", "stop");
        }
    }
    if (f->Has("stop_token_ids")) {
        const Json& s = body["stop_token_ids"];
        if (!s.is_array() ||
            !std::all_of(s.begin(), s.end(), [](const Json& e) { return e.is_number_integer(); })) {
            f->Fail("'stop_token_ids' must be an array of integers", "stop_token_ids");
        } else {
            // An id outside the vocabulary could never stop anything: say so rather than narrow
            // it to some other token's id.
            for (size_t i = 0; i < s.size() && f->ok(); ++i) {
                if (auto id = TokenId(s[i], tk)) {
                    sp.stop_token_ids.push_back(*id);
                } else {
                    f->Fail(fmt::format("stop_token_ids[{}] = {} is outside the vocabulary (0..{})",
                                        i, s[i].dump(), tk.vocab_size() - 1),
                            "stop_token_ids");
                }
            }
        }
    }
    if (chat) {
        bool lp = false;
        int64_t top = 0;
        f->Bool("logprobs", &lp);
        f->Int("top_logprobs", &top, 0, 20);
        out->want_logprobs = lp;
        sp.logprobs = lp ? static_cast<int>(top) : -1;
    } else {
        int64_t lp = -1;
        f->Int("logprobs", &lp, 0, 20);
        out->want_logprobs = lp >= 0;
        sp.logprobs = static_cast<int>(lp);
        bool echo = false;
        f->Bool("echo", &echo);
        if (echo) f->Fail("'echo' is not supported", "echo");
        if (f->Has("suffix")) f->Fail("'suffix' is not supported", "suffix");
    }
    if (!f->ok()) return;
    sp.temperature = static_cast<float>(temperature);
    sp.top_p = static_cast<float>(top_p);
    sp.top_k = static_cast<int>(top_k);

    // The prompt.
    tokenizer::PromptError pe;
    if (!tokenizer::PromptTokens(body, chat, tk, &out->prompt, &pe, image_tokens, &out->images)) {
        return f->Fail(std::move(pe.message), std::move(pe.param));
    }
    if (max_tokens < 0) max_tokens = 16;  // chat without a limit: set below from the context
    sp.max_tokens = static_cast<int>(max_tokens);
}

}  // namespace

namespace {

// A request body: a JSON object within the nesting limit.
bool ParseBody(std::string_view text, Json* body, BadRequest* error) {
    if (!JsonDepthWithin(text, kMaxJsonDepth)) {
        *error = {fmt::format("the body nests deeper than {} levels", kMaxJsonDepth), "", ""};
        return false;
    }
    *body = Json::parse(text.begin(), text.end(), nullptr, false);
    if (body->is_discarded()) {
        *error = {"the body is not valid JSON", "", ""};
        return false;
    }
    if (!body->is_object()) {
        *error = {"the body must be a JSON object", "", ""};
        return false;
    }
    return true;
}

}  // namespace

bool ParseOpenAiRequest(std::string_view text, bool chat, const tokenizer::Tokenizer& tk,
                        const std::string& model_name, int max_model_len, ParsedRequest* out,
                        BadRequest* error, const tokenizer::ImageTokens* image_tokens) {
    Json body;
    if (!ParseBody(text, &body, error)) return false;
    Fields fields(body);
    ParseRequest(body, chat, tk, model_name, out, &fields, image_tokens);
    if (fields.ok() && body.contains("kv_transfer_params") &&
        !body["kv_transfer_params"].is_null()) {
        const Json& kv = body["kv_transfer_params"];
        if (!kv.is_object()) {
            fields.Fail(fmt::format("'kv_transfer_params' must be an object, not {}",
                                    JsonFields::KindOf(kv)),
                        "kv_transfer_params");
        } else {
            out->kv_transfer_params = kv;
        }
    }
    if (fields.ok() && body.contains("ec_transfer_params") &&
        !body["ec_transfer_params"].is_null()) {
        const Json& ec = body["ec_transfer_params"];
        if (!ec.is_object()) {
            fields.Fail(fmt::format("'ec_transfer_params' must be an object, not {}",
                                    JsonFields::KindOf(ec)),
                        "ec_transfer_params");
        } else {
            out->ec_transfer_params = ec;
        }
    }
    for (const char* k : {"bootstrap_host", "bootstrap_port", "bootstrap_room"}) {
        if (fields.ok() && body.contains(k)) out->sglang_fields[k] = body[k];
    }
    if (fields.ok() && body.contains("ferry_continue") && !body["ferry_continue"].is_null()) {
        const Json& c = body["ferry_continue"];
        const Json* ids =
            c.is_object() && c.size() == 1 && c.contains("token_ids") ? &c["token_ids"] : nullptr;
        const bool good = ids && ids->is_array() && !ids->empty() &&
                          ids->size() <= size_t(std::max(1, max_model_len)) &&
                          std::all_of(ids->begin(), ids->end(), [&](const Json& t) {
                              return t.is_number_integer() && t.get<int64_t>() >= 0 &&
                                     t.get<int64_t>() < tk.vocab_size();
                          });
        if (!good) {
            fields.Fail(
                "'ferry_continue' must be {\"token_ids\": [...]}: 1 to max_model_len token ids of "
                "the vocabulary, the output a migrated stream already sent",
                "ferry_continue");
        } else {
            out->continued = ids->get<std::vector<int32_t>>();
        }
    }
    if (!fields.ok()) {
        *error = fields.error();
        return false;
    }
    if (chat && !body.contains("max_tokens") && !body.contains("max_completion_tokens")) {
        out->sampling.max_tokens =
            std::max(1, max_model_len - static_cast<int>(out->prompt.size()));
    }
    return true;
}

bool ParseTokenizeRequest(std::string_view text, const tokenizer::Tokenizer& tk,
                          const std::string& model_name, TokenizeRequest* out, BadRequest* error) {
    Json body;
    if (!ParseBody(text, &body, error)) return false;
    Fields f(body);
    CheckModel(&f, model_name);
    f.Bool("return_token_strs", &out->return_token_strs);
    const bool chat = f.Has("messages");
    if (chat && f.Has("prompt")) f.Fail("give 'prompt' or 'messages', not both", "prompt");
    // vLLM's defaults: special tokens (bos) for a prompt, none for messages (the template has
    // its own).
    bool add_special = !chat;
    f.Bool("add_special_tokens", &add_special);
    if (chat) {
        bool add_generation_prompt = true, continue_final = false;
        f.Bool("add_generation_prompt", &add_generation_prompt);
        f.Bool("continue_final_message", &continue_final);
        if (continue_final) {
            f.Fail("'continue_final_message' is not supported by this server",
                   "continue_final_message");
        }
        std::vector<tokenizer::ChatMessage> msgs;
        tokenizer::PromptError pe;
        if (f.ok() && !tokenizer::ChatMessages(body, &msgs, &pe)) {
            f.Fail(std::move(pe.message), std::move(pe.param));
        } else if (f.ok()) {
            auto rendered = tk.ApplyChatTemplate(msgs, add_generation_prompt);
            if (!rendered.ok()) {
                f.Fail(rendered.status().message(), "messages");
            } else {
                out->tokens = tk.Encode(*rendered, add_special && tk.add_bos());
            }
        }
    } else if (f.ok()) {
        if (!f.Has("prompt")) {
            f.Fail("'prompt' (a string) or 'messages' is required", "prompt");
        } else if (!body["prompt"].is_string()) {
            f.Fail(fmt::format("'prompt' must be a string, not {}",
                               JsonFields::KindOf(body["prompt"])),
                   "prompt");
        } else {
            out->tokens = tk.Encode(body["prompt"].get<std::string>(), add_special && tk.add_bos());
        }
    }
    if (!f.ok()) {
        *error = f.error();
        return false;
    }
    return true;
}

bool ParseDetokenizeRequest(std::string_view text, const tokenizer::Tokenizer& tk,
                            const std::string& model_name, std::vector<int32_t>* tokens,
                            BadRequest* error) {
    Json body;
    if (!ParseBody(text, &body, error)) return false;
    Fields f(body);
    CheckModel(&f, model_name);
    if (f.ok() && (!f.Has("tokens") || !body["tokens"].is_array())) {
        f.Fail("'tokens' must be an array of token ids", "tokens");
    }
    if (f.ok()) {
        for (const Json& e : body["tokens"]) {
            std::optional<int32_t> id;
            if (e.is_number_integer()) id = TokenId(e, tk);
            if (!id) {
                f.Fail(fmt::format("tokens: {} is not a token id (0..{})", e.dump(),
                                   tk.vocab_size() - 1),
                       "tokens");
                break;
            }
            tokens->push_back(*id);
        }
    }
    if (!f.ok()) {
        *error = f.error();
        return false;
    }
    return true;
}

}  // namespace ferry::serve

namespace ferry::serve {

namespace {

// One prompt's sampling_params (SGLang's SamplingParams): `name` prefixes errors.
Status ParseSglangSampling(const Json& sp, const std::string& name, const tokenizer::Tokenizer& tk,
                           model::SamplingParams* out, bool* max_given) {
    if (!sp.is_null() && !sp.is_object()) {
        return InvalidArgumentError(
            fmt::format("'{}' must be an object, not {}", name, JsonFields::KindOf(sp)));
    }
    static const std::set<std::string> kKnown = {"max_new_tokens",
                                                 "temperature",
                                                 "top_p",
                                                 "top_k",
                                                 "min_p",
                                                 "stop",
                                                 "stop_token_ids",
                                                 "ignore_eos",
                                                 "skip_special_tokens",
                                                 "spaces_between_special_tokens",
                                                 "n",
                                                 "frequency_penalty",
                                                 "presence_penalty",
                                                 "repetition_penalty",
                                                 "min_new_tokens",
                                                 "sampling_seed",
                                                 "no_stop_trim",
                                                 "json_schema",
                                                 "regex",
                                                 "ebnf",
                                                 "structural_tag",
                                                 "custom_params",
                                                 "stop_regex",
                                                 "logit_bias"};
    const Json empty = Json::object();
    const Json& j = sp.is_null() ? empty : sp;
    for (const auto& [k, v] : j.items()) {
        if (!kKnown.count(k)) {
            return InvalidArgumentError(
                fmt::format("'{}.{}' is not one of SGLang's sampling parameters", name, k));
        }
    }
    const JsonFields f(j, name);
    FERRY_ASSIGN_OR_RETURN(std::optional<int64_t> max, f.OptInt("max_new_tokens", 1, 1 << 30));
    *max_given = max.has_value();
    out->max_tokens = static_cast<int>(max.value_or(128));
    FERRY_ASSIGN_OR_RETURN(std::optional<double> t, f.OptNumber("temperature"));
    if (t && (*t < 0 || *t > 100)) return f.Bad("temperature", "must be in 0..100");
    out->temperature = static_cast<float>(t.value_or(1.0));
    FERRY_ASSIGN_OR_RETURN(std::optional<double> p, f.OptNumber("top_p"));
    if (p && !(*p > 0 && *p <= 1)) return f.Bad("top_p", "must be in (0, 1]");
    out->top_p = static_cast<float>(p.value_or(1.0));
    FERRY_ASSIGN_OR_RETURN(std::optional<int64_t> k, f.OptInt("top_k", -1, 1 << 24));
    out->top_k = static_cast<int>(k.value_or(-1));
    if (k && *k == 0) return f.Bad("top_k", "must be -1 (off) or at least 1");
    FERRY_ASSIGN_OR_RETURN(std::optional<bool> ie, f.OptBool("ignore_eos"));
    out->ignore_eos = ie.value_or(false);
    FERRY_ASSIGN_OR_RETURN(std::optional<int64_t> seed,
                           f.OptInt("sampling_seed", INT64_MIN, INT64_MAX));
    if (seed) out->seed = static_cast<uint64_t>(*seed);
    if (const Json* s = f.Given("stop")) {
        if (s->is_string()) {
            out->stop.push_back(s->get<std::string>());
        } else if (s->is_array() && s->size() <= 64 &&
                   std::all_of(s->begin(), s->end(), [](const Json& e) { return e.is_string(); })) {
            for (const Json& e : *s) out->stop.push_back(e.get<std::string>());
        } else {
            return f.Bad("stop", "must be a string or a list of at most 64 strings");
        }
    }
    if (const Json* s = f.Given("stop_token_ids")) {
        if (!s->is_array() || s->size() > 1024) {
            return f.Bad("stop_token_ids", "must be a list of at most 1024 token ids");
        }
        for (size_t i = 0; i < s->size(); ++i) {
            std::optional<int32_t> id = TokenId((*s)[i], tk);
            if (!id) {
                return InvalidArgumentError(
                    fmt::format("'{}.stop_token_ids[{}]' is not a token id of this model (0..{})",
                                name, i, tk.vocab_size() - 1));
            }
            out->stop_token_ids.push_back(*id);
        }
    }
    // The rest only at SGLang's neutral values: anything else would be silently ignored.
    struct Neutral {
        const char* key;
        Json value;
    };
    const Neutral neutral[] = {{"min_p", 0.0},
                               {"n", 1},
                               {"frequency_penalty", 0.0},
                               {"presence_penalty", 0.0},
                               {"repetition_penalty", 1.0},
                               {"min_new_tokens", 0},
                               {"skip_special_tokens", true},
                               {"spaces_between_special_tokens", true},
                               {"no_stop_trim", false}};
    for (const Neutral& n : neutral) {
        const Json* v = f.Given(n.key);
        if (!v) continue;
        const bool same = v->is_number() && n.value.is_number()
                              ? v->get<double>() == n.value.get<double>()
                              : *v == n.value;
        if (!same) {
            return InvalidArgumentError(fmt::format("'{}.{}' = {} is not supported here (only {})",
                                                    name, n.key, v->dump(), n.value.dump()));
        }
    }
    for (const char* k : {"json_schema", "regex", "ebnf", "structural_tag", "custom_params",
                          "stop_regex", "logit_bias"}) {
        if (f.Given(k)) {
            return InvalidArgumentError(
                fmt::format("'{}.{}' is not supported here (no constrained decoding)", name, k));
        }
    }
    return Status::Ok();
}

// Prompt i of a batch (or the one prompt): its token ids.
Status SglangPrompt(const Json& body, bool batch, size_t i, const tokenizer::Tokenizer& tk,
                    std::vector<int32_t>* out) {
    Json one;
    if (body.contains("text") && !body["text"].is_null()) {
        one["prompt"] = batch ? body["text"][i] : body["text"];
    } else {
        one["prompt"] = batch ? body["input_ids"][i] : body["input_ids"];
    }
    tokenizer::PromptError pe;
    if (!tokenizer::PromptTokens(one, false, tk, out, &pe)) {
        const std::string field = body.contains("text") && !body["text"].is_null()
                                      ? std::string("text")
                                      : std::string("input_ids");
        return InvalidArgumentError(
            fmt::format("'{}': {}", batch ? fmt::format("{}[{}]", field, i) : field, pe.message));
    }
    return Status::Ok();
}

}  // namespace

bool ParseGenerateRequest(std::string_view text, const tokenizer::Tokenizer& tk, int max_model_len,
                          GenerateRequest* out, BadRequest* error) {
    Json body;
    if (!ParseBody(text, &body, error)) return false;
    auto fail = [&](std::string message, std::string param) {
        *error = {std::move(message), std::move(param), ""};
        return false;
    };
    const bool has_text = body.contains("text") && !body["text"].is_null();
    const bool has_ids = body.contains("input_ids") && !body["input_ids"].is_null();
    if (has_text == has_ids) {
        return fail("exactly one of 'text' and 'input_ids' must be given", "text");
    }
    for (const char* k : {"input_embeds", "image_data", "audio_data", "video_data", "lora_path"}) {
        if (body.contains(k) && !body[k].is_null()) {
            return fail(fmt::format("'{}' is not supported by /generate here", k), k);
        }
    }
    size_t n = 1;
    if (has_text) {
        const Json& t = body["text"];
        if (t.is_array()) {
            out->batch = true;
            n = t.size();
        } else if (!t.is_string()) {
            return fail("'text' must be a string or a list of strings", "text");
        }
    } else {
        const Json& ids = body["input_ids"];
        if (!ids.is_array() || ids.empty()) {
            return fail("'input_ids' must be a list of token ids or a list of such lists",
                        "input_ids");
        }
        if (ids[0].is_array()) {
            out->batch = true;
            n = ids.size();
        }
    }
    if (out->batch && (n == 0 || n > 256)) {
        return fail(fmt::format("a batch has 1..256 prompts, not {}", n), "text");
    }
    const JsonFields f(body);
    auto opt_bool = [&](const char* key, bool* v) {
        Result<std::optional<bool>> b = f.OptBool(key);
        if (!b.ok()) return fail(b.status().message(), key);
        if (*b) *v = **b;
        return true;
    };
    if (!opt_bool("stream", &out->stream) || !opt_bool("return_logprob", &out->return_logprob) ||
        !opt_bool("return_text_in_logprobs", &out->return_text_in_logprobs)) {
        return false;
    }
    Result<std::optional<int64_t>> top = f.OptInt("top_logprobs_num", 0, 20);
    if (!top.ok()) return fail(top.status().message(), "top_logprobs_num");
    out->top_logprobs_num = static_cast<int>(top->value_or(0));
    Result<std::optional<int64_t>> start = f.OptInt("logprob_start_len", -1, INT32_MAX);
    if (!start.ok()) return fail(start.status().message(), "logprob_start_len");
    if (start->value_or(-1) != -1) {
        return fail(
            "'logprob_start_len' >= 0 asks for prompt log-probabilities, which are not "
            "computed here (only -1: the output's)",
            "logprob_start_len");
    }
    out->rids.assign(n, "");
    if (body.contains("rid") && !body["rid"].is_null()) {
        const Json& r = body["rid"];
        for (size_t i = 0; i < n; ++i) {
            const Json& e = r.is_array() ? (r.size() == n ? r[i] : Json()) : r;
            if (!e.is_string() || !ValidRequestId(e.get<std::string>())) {
                return fail(
                    "'rid' must be an id of 1..128 of [A-Za-z0-9._:-], or a list of one "
                    "per prompt",
                    "rid");
            }
            out->rids[i] = e.get<std::string>();
        }
    }
    const Json sp = body.contains("sampling_params") ? body["sampling_params"] : Json();
    if (sp.is_array() && (!out->batch || sp.size() != n)) {
        return fail("'sampling_params' is a list: it needs one object per prompt of a batch",
                    "sampling_params");
    }
    out->items.resize(n);
    for (size_t i = 0; i < n; ++i) {
        ParsedRequest& pr = out->items[i];
        Status st = SglangPrompt(body, out->batch, i, tk, &pr.prompt);
        if (!st.ok()) return fail(st.message(), has_text ? "text" : "input_ids");
        bool max_given = false;
        st = ParseSglangSampling(
            sp.is_array() ? sp[i] : sp,
            sp.is_array() ? fmt::format("sampling_params[{}]", i) : std::string("sampling_params"),
            tk, &pr.sampling, &max_given);
        if (!st.ok()) return fail(st.message(), "sampling_params");
        if (static_cast<int64_t>(pr.prompt.size()) + pr.sampling.max_tokens > max_model_len &&
            max_given) {
            return fail(fmt::format("prompt {} has {} tokens and asks for {} more; the model's "
                                    "length is {}",
                                    i, pr.prompt.size(), pr.sampling.max_tokens, max_model_len),
                        "sampling_params");
        }
        if (!max_given) {
            pr.sampling.max_tokens =
                std::max(1, std::min(pr.sampling.max_tokens,
                                     max_model_len - static_cast<int>(pr.prompt.size())));
        }
        pr.sampling.logprobs = out->return_logprob ? out->top_logprobs_num : -1;
        pr.want_logprobs = out->return_logprob;
        pr.stream = out->stream;
    }
    for (const char* k : {"bootstrap_host", "bootstrap_port", "bootstrap_room"}) {
        if (body.contains(k)) out->sglang_fields[k] = body[k];
    }
    return true;
}

}  // namespace ferry::serve
