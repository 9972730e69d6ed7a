//! The generate path in steps: admit a request into a [`Turn`], advance
//! any number of turns together by one batched model step, finish each
//! when it is done.

use std::panic::{catch_unwind, AssertUnwindSafe};

use onnx_genai_backend::{Entry, Input, Sequence};
use onnx_genai_scheduler::{Admission, AdmissionRequest};

use crate::constraint::Constraint;
use crate::detok::TextStream;
use crate::sampling::{log_softmax_top, Sampler, TokenLogprob};
use crate::{
    Admitted, ConversationId, Engine, EngineError, FinishReason, Flow, GenerateRequest, GenerateResult, SessionId,
    TokenEvent,
};

/// Where a turn stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TurnState {
    /// More steps to run.
    Running,
    /// Done (finished or failed): hand it to [`Engine::finish`].
    Done,
}

/// An admitted request in flight. It holds its reservation (released when
/// the turn is dropped or finished, A4) and its sequence (a session's, or a
/// fresh one).
pub struct Turn {
    admission: Admission,
    session: Option<SessionId>,
    sequence: Option<Box<dyn Sequence>>,
    /// The tokens this turn must run before it samples: what the session's
    /// KV lacks of its history, then the new prompt.
    feed: Vec<u32>,
    /// How much of `feed` has run.
    fed: usize,
    /// Where the new prompt starts in `feed`.
    new_start: usize,
    /// The sequence's length when the turn began (a failed turn goes back
    /// to it).
    kept: usize,
    request: GenerateRequest,
    generated: Vec<u32>,
    /// How far the streamed text has got.
    text: TextStream,
    sampler: Sampler,
    /// The response format's grammar, masking every choice.
    constraint: Option<Constraint>,
    /// Each generated token's log-probability, when asked for.
    logprobs: Vec<TokenLogprob>,
    max_new: usize,
    eos: Vec<u32>,
    logits: Vec<f32>,
    finish: Option<FinishReason>,
    error: Option<EngineError>,
    /// A panic raised by this turn's token callback: the turn fails alone,
    /// and [`Engine::generate_with`] re-raises it once the turn is put away.
    panic: Option<Box<dyn std::any::Any + Send>>,
    prompt_tokens: usize,
    /// Which of the request's choices this turn is.
    choice: usize,
    /// Choices still to make from this one once its prompt has run.
    forks: usize,
    /// Made from a copy of another choice's KV: its logits are the
    /// prompt's, and its first token is drawn without a model step.
    logits_ready: bool,
}

impl Turn {
    /// A turn of no session that has run nothing: the first choice's
    /// admission fills in the rest, a forked choice its feed.
    fn blank(
        admission: Admission,
        request: GenerateRequest,
        sampler: Sampler,
        max_new: usize,
        eos: Vec<u32>,
        prompt_tokens: usize,
    ) -> Self {
        Turn {
            admission,
            session: None,
            sequence: None,
            feed: Vec::new(),
            fed: 0,
            new_start: 0,
            kept: 0,
            request,
            generated: Vec::new(),
            text: TextStream::default(),
            sampler,
            constraint: None,
            logprobs: Vec::new(),
            max_new,
            eos,
            logits: Vec::new(),
            finish: None,
            error: None,
            panic: None,
            prompt_tokens,
            choice: 0,
            forks: 0,
            logits_ready: false,
        }
    }

    pub fn state(&self) -> TurnState {
        if self.finish.is_some() || self.error.is_some() {
            TurnState::Done
        } else {
            TurnState::Running
        }
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Whether the prompt is still being fed.
    pub fn prefilling(&self) -> bool {
        self.fed < self.feed.len()
    }

    /// Ends the turn early (a client that left): the next step skips it and
    /// it finishes as stopped.
    pub fn cancel(&mut self) {
        if self.state() == TurnState::Running {
            self.finish = Some(FinishReason::Stopped);
        }
    }

    /// The conversation admission counted this turn under (every choice of
    /// a request shares it).
    pub fn conversation(&self) -> onnx_genai_scheduler::ConversationId {
        self.admission.conversation
    }

    /// Which of its request's choices this turn is (0 for the first).
    pub fn choice(&self) -> usize {
        self.choice
    }

    /// Tokens admission counted for this turn (carried plus new, A5).
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Bytes the turn's reservation holds.
    pub fn reserved_bytes(&self) -> u64 {
        self.admission.bytes()
    }

    /// KV bytes the turn's sequence holds now.
    pub fn resident_bytes(&self) -> u64 {
        self.sequence.as_ref().map_or(0, |s| s.resident_bytes())
    }

    fn fail(&mut self, e: EngineError) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }
}

impl Engine {
    /// Steps 1–4 of the generate path: resolve the session, count tokens,
    /// admit, signal. Refusals of what the request asks are typed errors
    /// before anything is reserved or run (A2); `on_admitted` fires once,
    /// after the decision (A3). What the decode core then cannot run
    /// (undeclared bindings, more than one token row: step 5) fails the
    /// admitted turn, which releases its reservation before returning the
    /// error.
    pub fn admit(
        &mut self,
        request: &GenerateRequest,
        on_admitted: &mut dyn FnMut(Admitted),
    ) -> Result<Turn, EngineError> {
        // 1. Resolve the session and what it carries.
        let (conversation, carried) = match request.session {
            Some(id) => {
                let s = self.sessions.get(&id).ok_or(EngineError::UnknownSession(id))?;
                if s.sequence.is_none() {
                    return Err(EngineError::SessionBusy(id));
                }
                (s.conversation, s.tokens.len())
            }
            None => (ConversationId(crate::STATELESS_CONVERSATIONS | self.fresh_id()), 0),
        };
        // 2. Count tokens: carried plus new, rows as `rows * longest` (A5, A7).
        request.check()?;
        request.sampling.check_vocabulary(self.model.vocab_size()).map_err(EngineError::Request)?;
        let mut rows = self.prompt_ids(&request.prompt)?;
        if let Some(wf) = &self.workflow {
            if rows.len() != 1 {
                return Err(EngineError::Request(format!(
                    "a workflow runs one token row, the prompt has {}",
                    rows.len()
                )));
            }
            rows[0] = wf.expand(&rows[0], request)?;
        }
        let longest = rows.iter().map(Vec::len).max().unwrap_or(0);
        let prompt_tokens = carried + rows.len() * longest;
        let m = &self.package.manifest;
        let context = m.architecture.max_sequence_length as usize;
        if prompt_tokens >= context {
            return Err(EngineError::Request(format!(
                "the prompt has {prompt_tokens} tokens ({carried} carried) but the context length is {context} ({}), \
                 leaving no room to generate: shorten the prompt, or raise the context length if the model supports it",
                self.package.context_length_key()
            )));
        }
        let requested = request.max_new_tokens.unwrap_or(m.generation.max_new_tokens) as usize;
        let max_new = requested.min(context - prompt_tokens);
        // 3. Admit. The guard lives in the turn until it ends.
        let wanted = AdmissionRequest {
            conversation,
            prompt_tokens: prompt_tokens as u64,
            max_new_tokens: max_new as u64,
            // What the model stores per position (a cache may be narrower
            // than declared); nothing for a package that declares no KV
            // geometry (A8).
            bytes_per_token: self.package.kv_geometry().and(self.model.kv_bytes_per_token()),
            wait_until: None,
            granularity: self.model.kv_granularity() as u64,
        };
        // `n` choices hold `n` copies of the KV: one reservation for all,
        // split between them as they are made.
        let wanted = AdmissionRequest {
            bytes_per_token: wanted.bytes_per_token.map(|b| b.saturating_mul(request.n as u64)),
            ..wanted
        };
        let admission = self.reserve(&wanted, request.session)?;
        // The grammar is compiled once admitted (the route has compiled it
        // already, so this rarely fails; failing, the guard releases the
        // reservation): a request deferred for room is admitted again and
        // again while it waits, and recompiling on every try kept the
        // driver, and every stream of its model, waiting.
        let constraint = match self.prompter.constraint(&request.response_format) {
            Ok(constraint) => constraint,
            Err(e) => {
                // A continuing turn's admission holds its session's idle
                // bytes: they go back to the session, not with the rest.
                self.keep_idle(admission, request.session);
                return Err(e);
            }
        };
        // 4. Signal, after the decision and before any backend work.
        on_admitted(Admitted {
            conversation,
            prompt_tokens: prompt_tokens as u64,
            max_new_tokens: admission.max_new_tokens,
            reserved_bytes: admission.bytes(),
        });
        // 5. The split between execution kinds comes after admission: what a
        //    decode core refuses is refused by ending the admitted turn, which
        //    releases its reservation like every other ending.
        let max_new = admission.max_new_tokens as usize;
        // The repetition penalty reads the whole conversation: what the
        // session carries, then the new prompt.
        let carried_tokens = request.session.and_then(|id| self.sessions.get(&id)).map_or(&[][..], |s| &s.tokens[..]);
        let sampler = Sampler::new(request.sampling.clone())
            .with_prompt(carried_tokens.iter().chain(rows.iter().flatten()).copied());
        let eos = self.package.manifest.generation.eos_token_ids.clone();
        let mut turn = Turn {
            session: request.session,
            constraint,
            forks: request.n.saturating_sub(1),
            ..Turn::blank(admission, request.clone(), sampler, max_new, eos, prompt_tokens)
        };
        if let Err(e) = self.check_bindings(request).and_then(|()| self.bind_sequence(&mut turn, rows)) {
            turn.fail(e);
            return Err(self.abandon(turn));
        }
        Ok(turn)
    }

    /// Gives the turn its sequence (the session's, or a spare) and what it
    /// must feed: what the sequence's KV lacks of the history, then the new
    /// prompt.
    fn bind_sequence(&mut self, turn: &mut Turn, mut rows: Vec<Vec<u32>>) -> Result<(), EngineError> {
        if rows.len() != 1 {
            return Err(EngineError::Request(format!(
                "a decode core runs one token row, the prompt has {}",
                rows.len()
            )));
        }
        let new = rows.remove(0);
        let (sequence, history) = match turn.session {
            Some(id) => {
                let s = self.sessions.get_mut(&id).ok_or(EngineError::UnknownSession(id))?;
                let mut seq = s.sequence.take().ok_or(EngineError::SessionBusy(id))?;
                // A session's KV never holds more than its history (a turn
                // that failed mid-way may have left extra positions).
                if let Err(e) = seq.truncate(s.tokens.len()) {
                    s.sequence = Some(seq);
                    return Err(e.into());
                }
                (seq, s.tokens.clone())
            }
            None => (self.spare.pop().unwrap_or_else(|| self.model.new_sequence()), Vec::new()),
        };
        // A continuing turn prefills only what its KV does not hold yet.
        turn.kept = sequence.kv_len();
        turn.feed = history[turn.kept.min(history.len())..].to_vec();
        turn.new_start = turn.feed.len();
        turn.feed.extend_from_slice(&new);
        turn.sequence = Some(sequence);
        Ok(())
    }

    /// What of `admission` the session's KV holds stays reserved as its
    /// idle bytes (B2); the rest is released (the guard drops). Without a
    /// session, or a session without its sequence, all is released.
    fn keep_idle(&mut self, mut admission: onnx_genai_scheduler::Admission, session: Option<SessionId>) {
        let Some(s) = session.and_then(|id| self.sessions.get_mut(&id)) else { return };
        if let Some(bytes) = s.sequence.as_ref().map(|seq| seq.resident_bytes()) {
            admission.shrink_to(bytes);
            s.idle = Some(admission);
        }
    }

    /// Ends a turn that failed before it ran; its error.
    fn abandon(&mut self, turn: Turn) -> EngineError {
        match self.put_away(turn) {
            Err(e) => e,
            Ok(_) => EngineError::Request("the request was refused".into()),
        }
    }

    /// Admits `wanted`; a continuing turn takes over the bytes its session
    /// holds for its idle KV. When the budget is short, the KV of the least
    /// recently used idle sessions is freed (their history stays) before the
    /// request is refused: this engine's idle memory never keeps its own
    /// requests out. (Another engine's idle sessions on a shared budget are
    /// that engine's to spill: a server's drivers ask each other to, see
    /// [`Engine::give_way`].)
    fn reserve(
        &mut self,
        wanted: &AdmissionRequest,
        session: Option<SessionId>,
    ) -> Result<onnx_genai_scheduler::Admission, EngineError> {
        loop {
            let scheduler = self.scheduler.clone();
            let held = session.and_then(|id| self.sessions.get_mut(&id)).and_then(|s| s.idle.take());
            let decided = match held {
                Some(held) => scheduler.admit_over(wanted, held).map_err(|r| (r.error, Some(r.held))),
                None => scheduler.admit(wanted).map_err(|e| (e, None)),
            };
            match decided {
                Ok(admission) => return Ok(admission),
                Err((e, back)) => {
                    if let (Some(back), Some(s)) = (back, session.and_then(|id| self.sessions.get_mut(&id))) {
                        s.idle = Some(back);
                    }
                    let deferred = matches!(e, onnx_genai_scheduler::AdmissionError::Deferred { .. });
                    if !(deferred && self.spill_idle(session)) {
                        return Err(e.into());
                    }
                }
            }
        }
    }

    /// Refuses bindings the package does not declare (after admission, so a
    /// refused request's reservation is released by the returning error).
    fn check_bindings(&self, request: &GenerateRequest) -> Result<(), EngineError> {
        match &self.workflow {
            Some(wf) => wf.check_bindings(request),
            None => {
                if let Some(t) = request.inputs.first() {
                    return Err(EngineError::Request(format!(
                        "`{}` is not an application input of package `{}`: it declares no workflow inputs",
                        t.name, self.package.manifest.name
                    )));
                }
                if let Some(o) = request.overrides.first() {
                    return Err(EngineError::Request(format!(
                        "component `{}` cannot be overridden: package `{}` runs on a decode core without a workflow",
                        o.component, self.package.manifest.name
                    )));
                }
                Ok(())
            }
        }
    }

    /// Advances every running turn of `turns` by one model step: a prompt
    /// chunk for a turn still prefilling, its last sampled token otherwise,
    /// all in one batched call. Each turn that produced logits samples its
    /// next token and reports it to `on_token(index, event)`. A turn whose
    /// sequence fails (error or panic) fails alone; the others go on (B3).
    pub fn step(&mut self, turns: &mut [&mut Turn], on_token: &mut dyn FnMut(usize, TokenEvent<'_>) -> Flow) {
        // Inputs: token ids, or embeddings for a workflow's decoder.
        let mut embeds: Vec<Option<Vec<f32>>> = Vec::with_capacity(turns.len());
        let mut active = Vec::with_capacity(turns.len());
        // Choices made from another's KV draw their first token from the
        // prompt's logits, without a model step.
        let mut ready = Vec::new();
        for (i, turn) in turns.iter_mut().enumerate() {
            if turn.state() != TurnState::Running {
                embeds.push(None);
                continue;
            }
            if turn.logits_ready {
                ready.push(i);
                embeds.push(None);
                continue;
            }
            match self.workflow_input(turn) {
                Ok(e) => {
                    embeds.push(e);
                    active.push(i);
                }
                Err(e) => {
                    turn.fail(e);
                    embeds.push(None);
                }
            }
        }
        for &i in &ready {
            let turn = &mut *turns[i];
            turn.logits_ready = false;
            self.sample_reporting(turn, &mut |event| on_token(i, event));
        }
        if active.is_empty() {
            return;
        }
        let hidden = self.package.manifest.architecture.hidden_size as usize;
        let chunk = self.prefill_chunk;
        let failures = {
            let mut entries: Vec<(usize, Entry<'_>)> = Vec::with_capacity(active.len());
            let mut pasts = Vec::with_capacity(active.len());
            for (i, (turn, emb)) in turns.iter_mut().zip(&embeds).enumerate() {
                if !active.contains(&i) {
                    continue;
                }
                let Turn { sequence, feed, fed, generated, logits, .. } = &mut **turn;
                let Some(sequence) = sequence.as_deref_mut() else { continue };
                let input = match emb {
                    Some(values) => Input::Embeds { values, hidden },
                    None if *fed < feed.len() => {
                        let end = if chunk == 0 { feed.len() } else { feed.len().min(*fed + chunk) };
                        Input::Tokens(&feed[*fed..end])
                    }
                    None => Input::Tokens(std::slice::from_ref(generated.last().unwrap_or(&0))),
                };
                pasts.push(sequence.kv_len());
                entries.push((i, Entry { sequence, input, logits }));
            }
            run_isolated(&*self.model, &mut entries, &pasts)
        };
        for (i, error) in failures {
            turns[i].fail(error);
        }
        // Sample where a step produced the logits a token is drawn from.
        for i in active {
            let turn = &mut *turns[i];
            if turn.error.is_some() {
                continue;
            }
            let ran = match &embeds[i] {
                Some(e) => e.len() / hidden.max(1),
                None if turn.fed < turn.feed.len() => {
                    if chunk == 0 {
                        turn.feed.len() - turn.fed
                    } else {
                        (turn.feed.len() - turn.fed).min(chunk)
                    }
                }
                None => 1,
            };
            if turn.fed < turn.feed.len() {
                turn.fed += ran.min(turn.feed.len() - turn.fed);
                if turn.fed < turn.feed.len() {
                    continue;
                }
            }
            if turn.forks > 0 {
                // The prompt has run: the other choices start from here,
                // before this one's draw masks the logits.
                self.fork_choices(turn);
            }
            self.sample_reporting(turn, &mut |event| on_token(i, event));
        }
    }

    /// Draws the turn's next token; an error or a panicking callback fails
    /// the turn alone.
    fn sample_reporting(&self, turn: &mut Turn, on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow) {
        match catch_unwind(AssertUnwindSafe(|| self.sample(turn, on_token))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => turn.fail(e),
            Err(payload) => {
                turn.fail(EngineError::Panicked { backend: "token callback" });
                turn.panic = Some(payload);
            }
        }
    }

    /// Makes the other choices of `turn`'s request, whose prompt has just
    /// run: each takes its share of the reservation (A4 holds per choice),
    /// a copy of the KV, the prompt's logits and the grammar — or, on a
    /// backend that cannot copy KV, a fresh sequence that prefills the
    /// prompt itself — and samples with its own seed. They wait in `forked` for the caller.
    fn fork_choices(&mut self, turn: &mut Turn) {
        let others = std::mem::take(&mut turn.forks);
        let share = turn.admission.bytes() / (others as u64 + 1);
        for choice in 1..=others {
            let copy = turn.sequence.as_ref().map_or(Ok(None), |s| s.fork());
            let mut sampling = turn.request.sampling.clone();
            sampling.seed = sampling.seed.wrapping_add(choice as u64);
            let sampler = Sampler::new(sampling).with_prompt(turn.feed.iter().copied());
            let admission = turn.admission.split_off(share);
            let mut sibling = Turn {
                feed: turn.feed.clone(),
                new_start: turn.new_start,
                choice,
                ..Turn::blank(
                    admission,
                    turn.request.clone(),
                    sampler,
                    turn.max_new,
                    turn.eos.clone(),
                    turn.prompt_tokens,
                )
            };
            match copy {
                Ok(Some(sequence)) => {
                    sibling.sequence = Some(sequence);
                    sibling.fed = sibling.feed.len();
                    sibling.logits = turn.logits.clone();
                    sibling.logits_ready = true;
                }
                Ok(None) => sibling.sequence = Some(self.spare.pop().unwrap_or_else(|| self.model.new_sequence())),
                Err(e) => sibling.fail(e.into()),
            }
            // The first choice has drawn nothing yet: its grammar is at the
            // start, as each other choice's must be.
            sibling.constraint = turn.constraint.clone();
            self.forked.push(sibling);
        }
    }

    /// The embeddings a workflow turn runs next (`None` for a decode core).
    fn workflow_input(&mut self, turn: &Turn) -> Result<Option<Vec<f32>>, EngineError> {
        let Some(wf) = self.workflow.as_mut() else { return Ok(None) };
        if turn.fed < turn.feed.len() {
            wf.prefill_embeds(&turn.request, &turn.feed[turn.fed..], turn.new_start.saturating_sub(turn.fed)).map(Some)
        } else {
            wf.embed(std::slice::from_ref(turn.generated.last().unwrap_or(&0))).map(Some)
        }
    }

    /// Draws the next token from the turn's logits and reports it.
    fn sample(&self, turn: &mut Turn, on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow) -> Result<(), EngineError> {
        if turn.generated.len() >= turn.max_new {
            turn.finish = Some(FinishReason::Length);
            return Ok(());
        }
        // The model's own distribution, before the mask changes the logits.
        let spread = turn.request.logprobs.map(|k| log_softmax_top(&turn.logits, k));
        if let Some(constraint) = turn.constraint.as_mut() {
            constraint.mask(&mut turn.logits, &turn.eos).map_err(EngineError::Constrained)?;
        }
        let token = turn.sampler.pick(&turn.logits);
        if turn.eos.contains(&token) {
            turn.finish = Some(FinishReason::Eos);
            return Ok(());
        }
        let mut complete = false;
        if let Some(constraint) = turn.constraint.as_mut() {
            constraint.accept(token).map_err(EngineError::Constrained)?;
            // A complete grammar allows only the end: end now rather than
            // spend a model step on a forced end-of-sequence token.
            complete = constraint.is_done();
        }
        turn.generated.push(token);
        let delta = turn.text.next(&turn.generated, |ids| self.decode(ids))?;
        // (The chosen token is allowed, so the mask left its logit as it was.)
        let logprob = spread.map(|(lse, top)| TokenLogprob { token, logprob: turn.logits[token as usize] - lse, top });
        let flow = on_token(TokenEvent { token_id: token, text_delta: &delta, logprob: logprob.as_ref() });
        turn.logprobs.extend(logprob);
        if flow == Flow::Stop {
            turn.finish = Some(FinishReason::Stopped);
        } else if complete {
            turn.finish = Some(FinishReason::Eos);
        } else if turn.generated.len() >= turn.max_new {
            turn.finish = Some(FinishReason::Length);
        }
        Ok(())
    }

    /// Ends a turn: its sequence goes back to its session (or to the spares),
    /// its reservation is released (A4), and the result is reported. A
    /// failed turn leaves its session as it was before the turn.
    pub fn finish(&mut self, mut turn: Turn) -> Result<GenerateResult, EngineError> {
        let panic = turn.panic.take();
        let result = self.put_away(turn);
        if let Some(payload) = panic {
            std::panic::resume_unwind(payload);
        }
        result
    }

    /// [`Engine::finish`] without re-raising a callback's panic.
    fn put_away(&mut self, mut turn: Turn) -> Result<GenerateResult, EngineError> {
        let mut sequence = turn.sequence.take();
        let outcome = match turn.error.take() {
            Some(e) => {
                if let Some(seq) = sequence.as_mut() {
                    if seq.truncate(turn.kept).is_err() {
                        seq.reset();
                    }
                }
                Err(e)
            }
            None => Ok(()),
        };
        let new = turn.feed[turn.new_start.min(turn.feed.len())..].to_vec();
        self.clock += 1;
        // What the session's sequence keeps stays reserved while it is idle
        // (B2); the rest of the turn's reservation goes back.
        match turn.session {
            Some(id) => {
                if let Some(s) = self.sessions.get_mut(&id) {
                    if outcome.is_ok() {
                        s.tokens.extend_from_slice(&new);
                        s.turn_start = s.tokens.len();
                        s.tokens.extend_from_slice(&turn.generated);
                    }
                    // A turn refused before it took the sequence leaves it.
                    if sequence.is_some() {
                        s.sequence = sequence;
                    }
                    s.last_used = self.clock;
                }
            }
            None => {
                if let Some(mut seq) = sequence {
                    seq.reset();
                    self.spare.push(seq);
                }
            }
        }
        let Turn { admission, generated, finish, prompt_tokens, session, logprobs, choice, .. } = turn;
        let budget_cap = admission.budget_cap;
        // What the session keeps stays reserved; the rest is released on
        // every exit.
        self.keep_idle(admission, session);
        outcome?;
        let text = self.decode(&generated)?;
        Ok(GenerateResult {
            prompt_tokens,
            token_ids: generated,
            text,
            finish_reason: finish.unwrap_or(FinishReason::Length),
            budget_cap,
            session,
            logprobs,
            choice,
        })
    }
}

/// Runs `entries` as one batch; when that fails (an error or a panic), puts
/// every sequence back and runs each entry alone, so only the ones at fault
/// fail. Returns `(turn index, error)` for those.
fn run_isolated(
    model: &dyn onnx_genai_backend::DecodeModel,
    entries: &mut [(usize, Entry<'_>)],
    pasts: &[usize],
) -> Vec<(usize, EngineError)> {
    let backend = model.name();
    let run = |batch: &mut [Entry<'_>]| -> Result<(), EngineError> {
        match catch_unwind(AssertUnwindSafe(|| model.step(batch))) {
            Ok(r) => r.map_err(EngineError::from),
            Err(_) => Err(EngineError::Panicked { backend }),
        }
    };
    // A batch of references to the entries (the model takes them by slice).
    let mut batch: Vec<Entry<'_>> = entries
        .iter_mut()
        .map(|(_, e)| Entry { sequence: &mut *e.sequence, input: e.input, logits: &mut *e.logits })
        .collect();
    let first = run(&mut batch);
    drop(batch);
    let Err(error) = first else { return Vec::new() };
    if entries.len() == 1 {
        let _ = entries[0].1.sequence.truncate(pasts[0]);
        return vec![(entries[0].0, error)];
    }
    let mut failed = Vec::new();
    for ((i, e), past) in entries.iter_mut().zip(pasts) {
        let _ = e.sequence.truncate(*past);
        let mut one = [Entry { sequence: &mut *e.sequence, input: e.input, logits: &mut *e.logits }];
        if let Err(err) = run(&mut one) {
            let _ = e.sequence.truncate(*past);
            failed.push((*i, err));
        }
    }
    failed
}
