//! `keygate dlq …`: the dead-letter stream through the same code as
//! `/v1/dead-letters` (docs/operations.md).

use anyhow::Context as _;
use serde_json::json;

use super::args::{DlqCommand, DlqFilter};
use super::commands::confirm;
use super::render::{out, print_json, table, timestamp};
use super::Admin;
use crate::dead_letters::{self, Cursor, DeadLetterQuery, Letter, Selection, MAX_PAGE};

impl DlqFilter {
    fn query(&self, cursor: Option<String>, limit: u32) -> DeadLetterQuery {
        DeadLetterQuery {
            stream: self.stream.clone(),
            group: self.group.clone(),
            consumer: self.consumer.clone(),
            member: self.member.clone(),
            key: self.key.clone(),
            reason: self.reason.clone(),
            since: self.since.clone(),
            until: self.until.clone(),
            cursor,
            limit: Some(limit),
        }
    }
}

impl Admin {
    pub(super) async fn dlq_command(&self, command: DlqCommand) -> anyhow::Result<()> {
        match command {
            DlqCommand::Ls { filter, limit, cursor } => self.dlq_ls(&filter, limit, cursor).await,
            DlqCommand::Show { id } => self.dlq_show(&id).await,
            DlqCommand::Redrive { ids, filter } => {
                let letters = self.chosen(&ids, &filter).await?;
                self.dlq_redrive(letters).await
            }
            DlqCommand::Rm { ids, filter, force } => {
                let letters = self.chosen(&ids, &filter).await?;
                if !force
                    && !letters.is_empty()
                    && !confirm(&format!("WARNING: deleting {} dead letters. Are you sure? (y/n): ", letters.len()))?
                {
                    anyhow::bail!("operation canceled");
                }
                self.dlq_rm(letters).await
            }
        }
    }

    async fn dlq_ls(&self, filter: &DlqFilter, limit: u32, cursor: Option<String>) -> anyhow::Result<()> {
        let selection = filter.query(cursor, limit.min(MAX_PAGE as u32)).check(MAX_PAGE)?;
        let page = self.dead_letters.page(&selection).await?;
        let marks = self.dead_letters.redriven(&page.letters).await?;
        let views: Vec<_> = page.letters.iter().zip(marks).map(|(l, m)| l.view(m)).collect();
        if self.json {
            return print_json(&json!({"dead_letters": views, "next_cursor": page.next.map(Cursor::token)}));
        }
        if views.is_empty() {
            out!("no dead letters");
        } else {
            let mut rows =
                table(&["ID", "Stream", "Group", "Member", "Key", "Seq", "Attempts", "When", "Redriven", "Reason"]);
            for v in &views {
                let owner = match (&v.group, &v.consumer) {
                    (Some(g), _) => g.clone(),
                    (None, Some(c)) => format!("{c} (consumer)"),
                    (None, None) => "-".into(),
                };
                let number = |n: Option<u64>| n.map_or_else(|| "-".to_owned(), |n| n.to_string());
                rows.add_row(vec![
                    v.id.clone(),
                    v.stream.clone(),
                    owner,
                    v.member.clone(),
                    v.key.clone().unwrap_or_else(|| "-".into()),
                    number(v.stream_seq),
                    number(v.attempts),
                    timestamp(v.dead_lettered_at),
                    v.redriven.as_ref().map_or_else(|| "-".to_owned(), |r| format!("{} #{}", r.stream, r.stream_seq)),
                    v.reason.clone(),
                ]);
            }
            out!("{rows}");
        }
        if let Some(next) = page.next {
            out!("more: --cursor {}", next.token());
        }
        Ok(())
    }

    async fn dlq_show(&self, id: &str) -> anyhow::Result<()> {
        let letter = self.letter(id).await?;
        let mark = self.dead_letters.redriven(std::slice::from_ref(&letter)).await?.pop().flatten();
        let view = letter.view(mark);
        if self.json {
            return print_json(&view);
        }
        let owner = view
            .group
            .as_ref()
            .map(|g| format!("group {g}"))
            .or(view.consumer.as_ref().map(|c| format!("consumer {c}")));
        out!("dead letter {} of stream {}, {} member {}", view.id, view.stream, owner.unwrap_or_default(), view.member);
        out!(
            "subject {} key {} partition {:?} seq {:?}",
            view.subject,
            view.key.as_deref().unwrap_or("-"),
            view.partition,
            view.stream_seq
        );
        out!("dead-lettered {} after {:?} attempts: {}", timestamp(view.dead_lettered_at), view.attempts, view.reason);
        if let Some(r) = &view.redriven {
            out!("redriven {} to {} #{}", timestamp(r.at), r.stream, r.stream_seq);
        }
        for (name, values) in &view.headers {
            out!("{name}: {}", values.join(", "));
        }
        match (&view.data, &view.data_base64) {
            (Some(data), _) => out!("{}", data.get()),
            (None, Some(b64)) => out!("(base64) {b64}"),
            (None, None) => {}
        }
        Ok(())
    }

    async fn dlq_redrive(&self, letters: Vec<Letter>) -> anyhow::Result<()> {
        let max_payload = self.nats.server_info().max_payload;
        let outcomes =
            dead_letters::redrive_in_order(&self.js, &self.dead_letters, &self.streams, max_payload, letters).await?;
        let mut failures = 0;
        let mut report = Vec::with_capacity(outcomes.len());
        for (letter, outcome) in &outcomes {
            match outcome {
                Ok(done) => {
                    let verb = if done.earlier { "redriven earlier" } else { "redriven" };
                    report.push(json!({"id": letter.id(), "stream": done.redriven.stream, "stream_seq": done.redriven.stream_seq, "earlier": done.earlier}));
                    if !self.json {
                        out!("{} {verb} to {} #{}", letter.id(), done.redriven.stream, done.redriven.stream_seq);
                    }
                }
                Err(e) => {
                    failures += 1;
                    report.push(json!({"id": letter.id(), "error": e.to_string()}));
                    if !self.json {
                        out!("{} not redriven: {e}", letter.id());
                    }
                }
            }
        }
        if self.json {
            print_json(&report)?;
        }
        anyhow::ensure!(failures == 0, "{failures} of {} letters were not redriven", outcomes.len());
        Ok(())
    }

    async fn dlq_rm(&self, letters: Vec<Letter>) -> anyhow::Result<()> {
        let mut deleted = Vec::with_capacity(letters.len());
        for letter in &letters {
            if self.dead_letters.delete(letter).await? {
                deleted.push(letter.id());
            }
        }
        if self.json {
            return print_json(&json!({"deleted": deleted}));
        }
        out!("deleted {} dead letters", deleted.len());
        Ok(())
    }

    async fn letter(&self, id: &str) -> anyhow::Result<Letter> {
        let seq: u64 = id.parse().with_context(|| format!("{id:?} is not a dead letter id"))?;
        self.dead_letters.get(seq).await?.with_context(|| format!("no dead letter {id}"))
    }

    /// The letters named by id, or else every one the filter selects (a
    /// filter must name something).
    async fn chosen(&self, ids: &[String], filter: &DlqFilter) -> anyhow::Result<Vec<Letter>> {
        let query = filter.query(None, MAX_PAGE as u32);
        let Selection { filter: checked, .. } = query.check(MAX_PAGE)?;
        match (ids.is_empty(), checked.is_everything()) {
            (false, true) => {
                let mut letters = Vec::with_capacity(ids.len());
                for id in ids {
                    letters.push(self.letter(id).await?);
                }
                Ok(letters)
            }
            (true, false) => {
                let mut selection = query.check(MAX_PAGE)?;
                let mut letters = Vec::new();
                loop {
                    let page = self.dead_letters.page(&selection).await?;
                    letters.extend(page.letters);
                    match page.next {
                        Some(next) => selection.cursor = Some(next),
                        None => return Ok(letters),
                    }
                }
            }
            (false, false) => anyhow::bail!("give ids or filter flags, not both"),
            (true, true) => anyhow::bail!("give ids, or filter flags (--stream, --group, --key, --since…)"),
        }
    }
}
