// A parsed request into the engine, and its answer to the client: streamed (SSE chunks) or
// whole, completions and chat, with usage, logprobs and kv_transfer_params.
#include "core/json_fields.h"
#include "serve/openai_server_parts.h"

namespace ferry::serve {

using namespace server_parts;  // NOLINT(build/namespaces): the server's own parts

std::string OpenAiServer::Impl::Dispatch(const std::shared_ptr<http::Exchange>& ex, bool chat,
                                         ParsedRequest pr, std::function<bool(const Status&)> retry,
                                         std::string base) {
    const tokenizer::Tokenizer& tk = engine->model().tokenizer();
    // One id for the request in every process (vLLM's rule: "cmpl-" + X-Request-Id): the
    // router's id, which it sends to each worker, else 128 random bits (nothing about other
    // requests can be derived from it).
    if (base.empty()) base = RequestIdOf(ex->request());
    const char* prefix = chat ? "chatcmpl" : "cmpl";
    if (engine->IdInUse(fmt::format("{}-{}", prefix, base))) {
        // The id is in use here (another request sent with the same X-Request-Id, a router's
        // retry, a hold not yet released): this request goes by the same id with a random tail,
        // so the logs still join and the two never meet. Chosen before the stream's head, which
        // names it; Submit's AlreadyExists below covers a race with another request.
        base += "-" + RandomId128().substr(0, 8);
    }
    const std::string id = fmt::format("{}-{}", prefix, base);
    const Clock::time_point submitted = Clock::now();
    auto last = std::make_shared<Clock::time_point>(submitted);
    auto first = std::make_shared<bool>(true);
    auto pending = std::make_shared<Pending>();
    const std::string object = chat ? "chat.completion" : "text_completion";
    const std::string chunk_object = chat ? "chat.completion.chunk" : "text_completion";
    const int64_t created_at = UnixSeconds();

    auto usage_json = [](const engine::RequestOutput& o) {
        return Json{{"prompt_tokens", o.prompt_tokens},
                    {"completion_tokens", o.completion_tokens},
                    {"total_tokens", o.prompt_tokens + o.completion_tokens},
                    {"prompt_tokens_details", {{"cached_tokens", o.cached_tokens}}}};
    };
    // Log-probabilities of one output event, in the endpoint's format.
    const bool as_ids = pr.tokens_as_ids;
    auto logprobs_json = [&tk, chat, as_ids](const engine::RequestOutput& o, size_t* text_offset) {
        // A token's name: vLLM's (its text, or "bytes:\xNN" for part of a character), or
        // "token_id:N" when asked. The chat `bytes` field holds the token's own bytes, so a
        // client can join partial characters.
        auto name = [&](int32_t t) {
            return as_ids ? fmt::format("token_id:{}", t) : tk.LogprobName(t);
        };
        auto bytes = [&](int32_t t) {
            std::string b = tk.LogprobBytes(t);
            return std::vector<uint8_t>(b.begin(), b.end());
        };
        if (chat) {
            Json content = Json::array();
            for (size_t i = 0; i < o.tokens.size() && i < o.logprobs.size(); ++i) {
                Json top = Json::array();
                for (auto [tid, lp] : o.top_logprobs[i]) {
                    top.push_back({{"token", name(tid)}, {"logprob", lp}, {"bytes", bytes(tid)}});
                }
                content.push_back({{"token", name(o.tokens[i])},
                                   {"logprob", o.logprobs[i]},
                                   {"bytes", bytes(o.tokens[i])},
                                   {"top_logprobs", top}});
            }
            return Json{{"content", content}};
        }
        Json tokens = Json::array(), lps = Json::array(), tops = Json::array(),
             offsets = Json::array();
        for (size_t i = 0; i < o.tokens.size() && i < o.logprobs.size(); ++i) {
            tokens.push_back(name(o.tokens[i]));
            lps.push_back(o.logprobs[i]);
            Json top = Json::object();
            for (auto [tid, lp] : o.top_logprobs[i]) top[name(tid)] = lp;
            tops.push_back(o.top_logprobs[i].empty() ? Json() : top);
            offsets.push_back(*text_offset);
            *text_offset += tk.TokenBytes(o.tokens[i]).size();
        }
        return Json{{"tokens", tokens},
                    {"token_logprobs", lps},
                    {"top_logprobs", tops},
                    {"text_offset", offsets}};
    };
    auto sse = [](const Json& j) { return "data: " + DumpJson(j) + "\n\n"; };
    auto chunk = [this, id, chunk_object, created_at](Json choice) {
        return Json{{"id", id},
                    {"object", chunk_object},
                    {"created", created_at},
                    {"model", model_name},
                    {"choices", Json::array({std::move(choice)})}};
    };

    const bool stream = pr.stream;
    std::weak_ptr<http::Exchange> weak = ex;
    engine::Request er;
    er.id = id;
    er.prompt = pr.prompt;
    er.sampling = pr.sampling;
    er.kv_transfer = pr.kv_transfer;
    // A copy (each embedding is shared, not copied): `pr` must stay whole for the retry under
    // another id below (moving its images out here once made that retry run without them).
    er.mm = pr.mm;
    er.no_cache = pr.no_cache;
    er.continued = pr.continued;
    if (!pr.continued.empty()) {
        // The first worker sent the role chunk and the text of these tokens.
        pending->sent_role = true;
        for (int32_t t : pr.continued) pending->text_offset += tk.TokenBytes(t).size();
    }
    // vLLM's return_token_ids: the prompt's ids once (streamed: in the first chunk).
    auto prompt_ids = pr.return_token_ids
                          ? std::make_shared<std::optional<std::vector<int32_t>>>(pr.prompt)
                          : nullptr;
    // A request whose KV comes from elsewhere can fail before its first token for reasons
    // with their own status (a refused claim 409, an unreachable peer 503): its stream starts
    // with the first output, so that such an error is an HTTP status, not a 200 with an error
    // event (and a retry can still take it over).
    const bool late_head = stream && pr.kv_transfer != nullptr;
    // Runs on the engine's step thread: formats and hands bytes to the connection, never waits.
    er.on_output = [this, weak, pending, submitted, last, first, stream, chat, id, base, object,
                    created_at, chunk_object, want_logprobs = pr.want_logprobs,
                    include_usage = pr.include_usage, usage_json, logprobs_json, sse, chunk, retry,
                    prompt_ids](const engine::RequestOutput& o) {
        Clock::time_point now = Clock::now();
        {
            std::lock_guard lock(metrics.mu);
            if (!o.tokens.empty()) {
                if (*first) {
                    metrics.ttft.Observe(std::chrono::duration<double>(now - submitted).count());
                    *first = false;
                } else {
                    metrics.itl.Observe(std::chrono::duration<double>(now - *last).count());
                }
                metrics.AddTokens(o.tokens.size(), std::chrono::duration_cast<std::chrono::seconds>(
                                                       now.time_since_epoch())
                                                       .count());
            }
            *last = now;
            if (o.finish != engine::FinishReason::kNone) {
                metrics.e2e.Observe(std::chrono::duration<double>(now - submitted).count());
                ++metrics.finished[engine::FinishReasonName(o.finish)];
            }
        }
        const bool final = o.finish != engine::FinishReason::kNone;
        std::shared_ptr<http::Exchange> ex = weak.lock();
        std::unique_lock lock(pending->mu);
        if (final) pending->finished = true;
        if (!ex || ex->closed()) return;
        const bool nothing_sent = !stream ? true : !pending->stream_started;
        if (o.finish == engine::FinishReason::kError && nothing_sent &&
            pending->all.tokens.empty() && retry) {
            lock.unlock();
            if (retry(o.error)) return;
            lock.lock();
        }
        if (stream && !pending->stream_started) {
            if (o.finish == engine::FinishReason::kError) {
                return ex->Reply(Error(HttpStatusOf(o.error), {o.error.message(), "", ""}, base));
            }
            pending->stream_started = true;
            ex->StartStream(200, "text/event-stream",
                            {{"Cache-Control", "no-cache"}, {"X-Request-Id", base}});
        }
        if (!stream) {
            engine::RequestOutput& all = pending->all;
            all.tokens.insert(all.tokens.end(), o.tokens.begin(), o.tokens.end());
            all.logprobs.insert(all.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
            all.top_logprobs.insert(all.top_logprobs.end(), o.top_logprobs.begin(),
                                    o.top_logprobs.end());
            all.text += o.text;
            if (!final) return;
            all.finish = o.finish;
            all.prompt_tokens = o.prompt_tokens;
            all.completion_tokens = o.completion_tokens;
            all.cached_tokens = o.cached_tokens;
            if (o.finish == engine::FinishReason::kError) {
                // A transfer that failed is the remote worker's fault (503), refused params
                // the caller's (400, 403, 409, 429); 500 only for a fault of this worker.
                return ex->Reply(Error(HttpStatusOf(o.error), {o.error.message(), "", ""}, base));
            }
            size_t offset = 0;
            Json choice = {{"index", 0}, {"finish_reason", engine::FinishReasonName(all.finish)}};
            if (chat) {
                choice["message"] = {{"role", "assistant"}, {"content", all.text}};
            } else {
                choice["text"] = all.text;
            }
            choice["logprobs"] = want_logprobs ? logprobs_json(all, &offset) : Json();
            if (prompt_ids) {
                choice["token_ids"] = all.tokens;
                if (!chat) choice["prompt_token_ids"] = **prompt_ids;
            }
            Json out = {{"id", id},
                        {"object", object},
                        {"created", created_at},
                        {"model", model_name},
                        {"choices", Json::array({choice})},
                        {"usage", usage_json(all)}};
            if (prompt_ids && chat) out["prompt_token_ids"] = **prompt_ids;
            if (o.kv_transfer) {
                out["kv_transfer_params"] = o.kv_transfer->ToJson();
            }
            return ex->Reply({200, "application/json", DumpJson(out), {{"X-Request-Id", base}}});
        }
        std::string bytes;
        if (chat && !pending->sent_role) {
            pending->sent_role = true;
            bytes += sse(chunk({{"index", 0},
                                {"delta", {{"role", "assistant"}, {"content", ""}}},
                                {"logprobs", Json()},
                                {"finish_reason", Json()}}));
        }
        if (o.finish == engine::FinishReason::kError) {
            bytes += router::ErrorEvent(HttpStatusOf(o.error), {o.error.message()}, base);
            ex->Write(std::move(bytes));
            return ex->End();
        }
        Json c = {{"index", 0}};
        if (chat) {
            c["delta"] = o.text.empty() && final ? Json::object() : Json{{"content", o.text}};
        } else {
            c["text"] = o.text;
        }
        c["logprobs"] = want_logprobs ? logprobs_json(o, &pending->text_offset) : Json();
        c["finish_reason"] = final ? Json(engine::FinishReasonName(o.finish)) : Json();
        Json ch = chunk(c);
        if (prompt_ids) {
            Json& choice = ch["choices"][0];
            choice["token_ids"] = o.tokens;
            if (*prompt_ids) {
                // vLLM's placement: on the completion choice, on the chat chunk.
                (chat ? ch : choice)["prompt_token_ids"] = std::move(**prompt_ids);
                prompt_ids->reset();
            }
        }
        bytes += sse(ch);
        if (final && include_usage) {
            bytes += sse({{"id", id},
                          {"object", chunk_object},
                          {"created", created_at},
                          {"model", model_name},
                          {"choices", Json::array()},
                          {"usage", usage_json(o)}});
        }
        if (final) bytes += "data: [DONE]\n\n";
        ex->Write(std::move(bytes));
        if (final) ex->End();
    };
    if (stream && !late_head) {
        pending->stream_started = true;
        ex->StartStream(200, "text/event-stream",
                        {{"Cache-Control", "no-cache"}, {"X-Request-Id", base}});
    }
    Status st = engine->Submit(std::move(er));
    if (st.code() == Code::kAlreadyExists && base.size() < 200) {
        // The id is still in use here (a router's retry, a hold not yet released): the same id
        // with a random tail, so the logs still join.
        return Dispatch(ex, chat, std::move(pr), std::move(retry),
                        base + "-" + RandomId128().substr(0, 8));
    }
    if (!st.ok()) {
        int status = HttpStatusOf(st);
        if (status == 500) status = 400;
        BadRequest e{st.message(), st.code() == Code::kInvalidArgument ? "prompt" : "", ""};
        if (!stream || late_head) {
            ex->Reply(Error(status, e, base));
            return "";
        }
        ex->Write(router::ErrorEvent(status, {e.message, e.param, e.code}, base));
        ex->End();
        return "";
    }
    // A client that goes away has its request aborted and its blocks freed.
    ex->OnClose([engine = engine, id, pending] {
        bool finished;
        {
            std::lock_guard lock(pending->mu);
            finished = pending->finished;
        }
        if (!finished) engine->Abort(id);
    });
    return id;
}

}  // namespace ferry::serve
